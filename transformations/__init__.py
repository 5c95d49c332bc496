"""OpenVINO graph passes of ov_kvcrush (installed as ``ov_kvcrush.transformations``).

* :func:`~ov_kvcrush.transformations.paged_attention.convert_model`: replace each layer's
  ScaledDotProductAttention and its ReadValue/Concat/Assign KV state in optimum's stateful IR by
  ``ov_kvcrush::PagedAttention``, whose cache lives in the CPU extension (``plugins/cpu``).
* :func:`~ov_kvcrush.transformations.plugin_attention.convert_model_for_plugin`: the same
  layers, for OpenVINO's GPU plugin: our ``SimpleGPU`` layers (``ov_kvcrush.gpu.plugin_layers``)
  over a pool the model takes as an input.
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
from ov_kvcrush.transformations.plugin_attention import PLUGIN_INPUTS, convert_model_for_plugin

__all__ = [
    "COMPUTE",
    "LOGITS_INPUT",
    "PLUGIN_INPUTS",
    "SEQUENCE_INPUT",
    "AttentionShape",
    "ConversionError",
    "ConvertedModel",
    "convert_model",
    "convert_model_for_plugin",
]
