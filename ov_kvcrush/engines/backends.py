"""The backends by name, and the model path each one runs (an IR directory or an HF checkpoint).

Apart from :mod:`ov_kvcrush.engines` so that the serving loop, which the openvino engine runs
on, can resolve a model path without importing the engines' factory.
"""

from __future__ import annotations

import os
from pathlib import Path

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
    check_backend(backend)
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
    from ov_kvcrush.engines.random_model import is_random_model, random_architecture
    from ov_kvcrush.models.export import ensure_default_model, export_model, hf_checkpoint

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError("model", model, "a path (str or os.PathLike), or None for the embedded model")
    if is_random_model(model):
        if backend != "torch":
            raise ConfigError("model", model, f"a model path for backend {backend} (random weights run on torch only)")
        random_architecture(str(model))  # an unknown architecture is refused here, listing the known ones
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


def check_backend(backend: str) -> None:
    if not isinstance(backend, str):
        raise ConfigError("backend", backend, "one of " + ", ".join(BACKENDS))
    if backend in PLANNED_BACKENDS:
        raise UserError(
            f"--backend={backend} is not built yet (issue #{PLANNED_BACKENDS[backend]}); available: "
            + ", ".join(BACKENDS)
        )
    if backend not in BACKENDS:
        raise UserError(f"--backend={backend!r} is invalid: allowed {', '.join(BACKENDS)}")
