"""Engines: the same ``generate`` API and :class:`GenerationResult` over different runtimes.

* ``genai``: native ``openvino_genai`` (the anchor we compare against), on an exported IR;
* ``torch``: transformers through the project's compressed cache (the oracle, and the CUDA path),
  on a Hugging Face checkpoint;
* ``openvino``: the exported IR with our paged-attention op (``plugins/cpu``) in place of each
  layer's SDPA and KV state, on the CPU plugin.

:func:`make_engine` resolves the model for the backend: by default the embedded model (exported to
IR or converted to an HF checkpoint once, then cached), or a user path.
"""

from __future__ import annotations

from pathlib import Path

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer
from ov_kvcrush.errors import UserError

#: Backend name → the issue that brings it, for those not built yet.
PLANNED_BACKENDS: dict[str, int] = {}
BACKENDS = ("genai", "torch", "openvino")


def resolve_model(backend: str, model: str | Path | None) -> Path:
    """The model path ``backend`` runs: an IR directory (genai, openvino) or an HF checkpoint (torch).

    ``None`` is the embedded model. A GGUF file or an HF directory is exported (genai) or
    converted (torch) once and cached; an exported IR directory is used as is by genai.
    """
    from ov_kvcrush.export import ensure_default_model, export_model, hf_checkpoint

    _check_backend(backend)
    if backend in ("genai", "openvino"):
        if model is None:
            return ensure_default_model()
        path = Path(model).expanduser()
        return path if (path / "openvino_model.xml").is_file() else export_model(path)
    if model is not None and (Path(model).expanduser() / "openvino_model.xml").is_file():
        raise UserError(
            f"--backend torch needs a Hugging Face checkpoint or a GGUF file, got an OpenVINO IR directory: {model}"
        )
    return hf_checkpoint(model)


def _check_backend(backend: str) -> None:
    if backend in PLANNED_BACKENDS:
        raise UserError(
            f"--backend={backend} is not built yet (issue #{PLANNED_BACKENDS[backend]}); available: "
            + ", ".join(BACKENDS)
        )
    if backend not in BACKENDS:
        raise UserError(f"--backend={backend!r} is invalid: allowed {', '.join(BACKENDS)}")


def make_engine(
    backend: str,
    model_dir: str | Path,
    compression: CompressionConfig | None = None,
    device: str = "CPU",
    **options,
):
    """Create the engine for ``backend`` on an already resolved model (see :func:`resolve_model`)."""
    _check_backend(backend)
    if backend == "genai":
        from ov_kvcrush.engines.genai import GenAIEngine

        return GenAIEngine(model_dir, compression, device=device, **options)
    if backend == "openvino":
        from ov_kvcrush.engines.openvino_engine import OpenVINOEngine

        return OpenVINOEngine(model_dir, compression, device=device, **options)
    from ov_kvcrush.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, compression, device=device, **options)


__all__ = ["BACKENDS", "GenerationResult", "Prompt", "Streamer", "make_engine", "resolve_model"]
