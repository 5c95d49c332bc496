"""OpenVINO graph passes of ov_kvcrush (installed as ``ov_kvcrush.transformations``).

* :func:`~ov_kvcrush.transformations.paged_attention.convert_model`: replace each layer's
  ScaledDotProductAttention and its ReadValue/Concat/Assign KV state in optimum's stateful IR by
  ``ov_kvcrush::PagedAttention``, whose cache lives in the CPU extension (``plugins/cpu``).
"""

from ov_kvcrush.transformations.paged_attention import (
    COMPUTE,
    LOGITS_INPUT,
    SEQUENCE_INPUT,
    AttentionShape,
    ConversionError,
    ConvertedModel,
    convert_model,
)

__all__ = [
    "COMPUTE",
    "LOGITS_INPUT",
    "SEQUENCE_INPUT",
    "AttentionShape",
    "ConversionError",
    "ConvertedModel",
    "convert_model",
]
