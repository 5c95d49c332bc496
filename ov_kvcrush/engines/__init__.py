"""Engines: the same ``generate`` API and :class:`GenerationResult` over different runtimes.

``genai`` (native openvino_genai) exists now; ``torch`` and ``openvino`` (our op) come with their
issues and register here.
"""

from __future__ import annotations

from pathlib import Path

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer
from ov_kvcrush.errors import UserError

#: Backend name → the issue that brings it, for those not built yet.
PLANNED_BACKENDS = {"torch": 4, "openvino": 6}
BACKENDS = ("genai",)


def make_engine(backend: str, model_dir: str | Path, compression: CompressionConfig, device: str = "CPU"):
    """Create the engine for ``backend``; a clear error for unknown or not-yet-built backends."""
    if backend == "genai":
        from ov_kvcrush.engines.genai import GenAIEngine

        return GenAIEngine(model_dir, compression, device=device)
    if backend in PLANNED_BACKENDS:
        raise UserError(f"--backend={backend} is not built yet (issue #{PLANNED_BACKENDS[backend]}); available: genai")
    raise UserError(f"--backend={backend!r} is invalid: allowed {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "GenerationResult", "Prompt", "Streamer", "make_engine"]
