"""MiniKV (seed 003): heavy hitters chosen once at prefill, stored 2-bit, pyramid budgets across layers.

MiniKV is a composition of pieces defined elsewhere, so this module is only its configuration:

* selection: prompt tokens scored by cumulative attention (``selection="h2o"``: the per-head
  column sums its selective flash attention returns; ``snapkv`` also works), per KV head, sinks
  and the recent window kept; the set is chosen once, at the end of prefill, and **frozen**:
  generated tokens are all kept, nothing is evicted later (so quantized key groups stay intact);
* budgets: PyramidKV-style linear per-layer budgets (:func:`~ov_kvcrush.methods.importance.pyramid_budgets`);
* storage: :class:`~ov_kvcrush.methods.store.QuantStore`, bit-packed 2-bit keys per channel and
  values per token, fp16 scales/zeros per group of 16, the newest ``residual_tokens`` in full
  precision, flushed every ``residual_tokens`` steps (see :mod:`ov_kvcrush.methods.quant`);
* attention: dequantizes the store and returns per-head cumulative scores
  (:func:`~ov_kvcrush.methods.attention.attend` with ``return_scores=True``).

Paper: Sharma et al., "MiniKV: Pushing the Limits of LLM Inference via 2-Bit Layer-Discriminative
KV Cache", arXiv 2411.18077 (seed 003); the 2-bit format follows KIVI (Liu et al., "KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750).

Where this departs from it:

* The selective flash-attention kernel is the reference attention with ``return_scores`` (and, in
  the op, a score pass fused into the decode attention); the scores are the same.
* Sinks and a recent window are always kept besides the heavy hitters; the pyramid is linear
  (``pyramid_depth``), as PyramidKV's.
* Generated tokens are all kept (quantized every ``residual_tokens``), as in the paper; the 2-bit
  store also serves under any other selection method (``quant``), which the paper does not do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ov_kvcrush.methods.base import QuantSettings
from ov_kvcrush.methods.importance import PyramidKVConfig


@dataclass(frozen=True)
class MiniKVConfig(PyramidKVConfig):
    """MiniKV: frozen prefill heavy hitters in a 2-bit store with pyramid budgets.

    Attributes:
        selection: ``h2o`` (cumulative attention over the prompt, MiniKV's choice) or ``snapkv``.
        pyramid_depth: pyramid steepness (see :class:`~ov_kvcrush.methods.importance.PyramidKVConfig`);
            2 by default.
        quant: the 2-bit store settings (``None`` keeps full precision, for ablations).
    """

    name: ClassVar[str] = "minikv"
    engines: ClassVar[tuple[str, ...]] = ("torch", "openvino")
    #: the prefill selection is never revisited (see the module docstring)
    frozen_selection: ClassVar[bool] = True
    selection: str = "h2o"
    pyramid_depth: float = 2.0
    quant: QuantSettings | None = field(default_factory=QuantSettings)
