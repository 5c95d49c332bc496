"""ov_kvcrush: KV-cache compression for LLM inference with OpenVINO.

The package is layered so data flows one way: configuration (:mod:`ov_kvcrush.config`) → engine
(:mod:`ov_kvcrush.engines`) → paged block cache → method policy → attention. Heavy dependencies
(openvino_genai, transformers, torch) are imported lazily by the modules that need them, so
``import ov_kvcrush`` and ``ov-kvcrush --help`` stay fast.
"""

from ov_kvcrush.config import CompressionConfig, GenerationSettings, KVCrushSettings
from ov_kvcrush.errors import UserError

# Imported where used, inside functions: what pulls in numpy, platformdirs, heavy to import, so that
# importing this module stays light.

__version__ = "0.1.0"

__all__ = ["CompressionConfig", "GenerationSettings", "KVCrushSettings", "LLMPipeline", "UserError", "__version__"]


def __getattr__(name: str):
    # LLMPipeline pulls in the engines; load it on first use only.
    if name == "LLMPipeline":
        from ov_kvcrush.pipeline import LLMPipeline

        return LLMPipeline
    raise AttributeError(f"module 'ov_kvcrush' has no attribute {name!r}")
