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
from ov_kvcrush.engines.backends import BACKENDS, PLANNED_BACKENDS, check_backend, resolve_model
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer
from ov_kvcrush.errors import ConfigError, UserError, one_line


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
    check_backend(backend)
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError("model", model_dir, "a path (str or os.PathLike)")
    if not isinstance(device, str):
        raise ConfigError("device", device, "a device name such as CPU or cuda")
    if compression is not None and not isinstance(compression, CompressionConfig):
        raise ConfigError("compression", compression, "a CompressionConfig")
    if backend == "torch":
        from ov_kvcrush.engines.torch_device import resolve_device

        resolve_device(device)  # refused before the engine's modules load (transformers': seconds)
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


__all__ = ["BACKENDS", "PLANNED_BACKENDS", "GenerationResult", "Prompt", "Streamer", "make_engine", "resolve_model"]
