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

import inspect
import os
from collections.abc import Mapping
from pathlib import Path

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer
from ov_kvcrush.errors import ConfigError, UserError, one_line

#: Backend name → the issue that brings it, for those not built yet.
PLANNED_BACKENDS: dict[str, int] = {}
BACKENDS = ("genai", "torch", "openvino")


def resolve_model(backend: str, model: str | Path | None) -> Path | str:
    """The model path ``backend`` runs: an IR directory (genai, openvino) or an HF checkpoint (torch).

    ``None`` is the embedded model. A GGUF file or an HF directory is exported (genai) or
    converted (torch) once and cached; an exported IR directory is used as is by genai.
    ``random:<architecture>`` (torch only) is returned as it is: the engine builds it
    (:mod:`ov_kvcrush.engines.random_model`).
    """
    _check_backend(backend)
    try:
        return _resolve_model(backend, model)
    except (RuntimeError, ValueError, OSError, EOFError) as exc:
        if isinstance(exc, UserError):
            raise
        where = model or "(the embedded model)"
        raise UserError(
            f"cannot read the model {where} for backend {backend} (is the file complete?): {one_line(exc)}"
        ) from exc


def _resolve_model(backend: str, model: str | Path | None) -> Path | str:
    from ov_kvcrush.engines.random_model import is_random_model, random_config
    from ov_kvcrush.models.export import ensure_default_model, export_model, hf_checkpoint

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError("model", model, "a path (str or os.PathLike), or None for the embedded model")
    if is_random_model(model):
        if backend != "torch":
            raise ConfigError("model", model, f"a model path for backend {backend} (random weights run on torch only)")
        random_config(str(model))  # an unknown architecture is refused here, listing the known ones
        return str(model)
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
    if not isinstance(backend, str):
        raise ConfigError("backend", backend, "one of " + ", ".join(BACKENDS))
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
    """Create the engine for ``backend`` on an already resolved model (see :func:`resolve_model`).

    ``options`` are the engine's own keyword arguments; one it does not take is refused by name
    with the ones it does. A model the runtime cannot load (a truncated GGUF, a broken IR) is a
    :class:`~ov_kvcrush.errors.UserError` naming the file, not the runtime's traceback.
    """
    _check_backend(backend)
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError("model", model_dir, "a path (str or os.PathLike)")
    if not isinstance(device, str):
        raise ConfigError("device", device, "a device name such as CPU or cuda")
    if compression is not None and not isinstance(compression, CompressionConfig):
        raise ConfigError("compression", compression, "a CompressionConfig")
    engine_cls = _engine_class(backend)
    taken = [n for n in inspect.signature(engine_cls).parameters if n not in ("model_dir", "compression", "device")]
    for name, value in options.items():
        if name not in taken:
            raise ConfigError(name, value, f"an option of backend {backend}: " + ", ".join(taken))
    if options.get("properties") is not None and not isinstance(options["properties"], Mapping):
        raise ConfigError("properties", options["properties"], "a mapping of OpenVINO properties")
    try:
        return engine_cls(model_dir, compression, device=device, **options)
    except (RuntimeError, ValueError, OSError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(
            f"backend {backend} cannot load the model {model_dir} (are its files complete?): {one_line(exc)}"
        ) from exc


def _engine_class(backend: str) -> type:
    if backend == "genai":
        from ov_kvcrush.engines.genai import GenAIEngine

        return GenAIEngine
    if backend == "openvino":
        from ov_kvcrush.engines.openvino_engine import OpenVINOEngine

        return OpenVINOEngine
    from ov_kvcrush.engines.torch_engine import TorchEngine

    return TorchEngine


__all__ = ["BACKENDS", "GenerationResult", "Prompt", "Streamer", "make_engine", "resolve_model"]
