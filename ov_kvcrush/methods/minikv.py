"""MiniKV (seed 003): heavy hitters chosen once at prefill, in a quantized store, pyramid budgets.

MiniKV is a composition of pieces defined elsewhere, so this module is only its configuration:

* selection: prompt tokens scored per KV head, sinks and the recent window kept; the set is
  chosen once, at the end of prefill, and **frozen**: generated tokens are all kept, nothing is
  evicted later (so quantized key groups stay intact). ``selection="snapkv"`` (the default)
  scores by the prompt's last queries, pooled; ``"h2o"`` by cumulative attention over every
  prompt query (the paper's: the per-head column sums its selective flash attention returns);
* budgets: PyramidKV-style linear per-layer budgets (:func:`~ov_kvcrush.methods.importance.pyramid_budgets`);
* storage: :class:`~ov_kvcrush.methods.store.QuantStore`, bit-packed keys per channel and values
  per token (4 bits by default, 2 in the paper), fp16 scales/zeros per group of 16, the newest
  ``residual_tokens`` in full precision, flushed every ``residual_tokens`` steps (see
  :mod:`ov_kvcrush.methods.quant`);
* attention: dequantizes the store and returns per-head cumulative scores
  (:func:`~ov_kvcrush.methods.attention.attend` with ``return_scores=True``).

``preset=paper`` (``minikv:preset=paper``) gives the paper's choices: H2O scores, a 2-bit store
with the prompt quantized too (no full-precision tail), a pyramid of depth 7 and no extra sinks.

Paper: Sharma et al., "MiniKV: Pushing the Limits of LLM Inference via 2-Bit Layer-Discriminative
KV Cache", arXiv 2411.18077 (seed 003); the 2-bit format follows KIVI (Liu et al., "KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750).

Where this departs from it:

* **The defaults are not the paper's** (issue 24, docs/quality.md "MiniKV's defaults"): on
  needle questions (SmolLM2, our op, 3k-token prompts, budget 1024) the paper's choices
  answered 0/12 where the full cache answered 11/12. The selection was the first cause (H2O's
  sums over every prompt query keep about half of a needle's digits, SnapKV's window 81-95 %),
  2-bit keys the second (SnapKV selection over 2 bits: 4/12; keys 4 and values 2 bits: 11/12;
  4 bits: 11/12, and at 6k 7/12 against 5/12 for 2-bit values, full cache 8/12). So the
  product selects by SnapKV's window and stores 4 bits; ``preset=paper`` keeps the paper's.
* The selective flash-attention kernel is the reference attention with ``return_scores`` (and, in
  the op, a score pass fused into the decode attention); the scores are the same. H2O scores
  are summed per KV-head group (the paper keeps them per query head).
* Sinks and a recent window of fixed sizes are always kept besides the heavy hitters (the
  paper's recent window is 25 % of the prompt); the pyramid is linear (``pyramid_depth``), as
  PyramidKV's.
* Generated tokens are all kept (quantized every ``residual_tokens``), as in the paper; the
  quantized store also serves under any other selection method (``quant``), which the paper
  does not do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ov_kvcrush.methods.base import QuantSettings
from ov_kvcrush.methods.importance import PyramidKVConfig
from ov_kvcrush.methods.runtimes import ADAPTIVE_HEAD_BUDGETS, FULL_PRECISION_STORE, SPANS, Declaration


@dataclass(frozen=True)
class MiniKVConfig(PyramidKVConfig):
    """MiniKV: frozen prefill heavy hitters in a quantized store with pyramid budgets.

    Attributes:
        selection: ``snapkv`` (the prompt's last queries, pooled: the default) or ``h2o``
            (cumulative attention over the prompt, MiniKV's choice).
        pyramid_depth: pyramid steepness (see :class:`~ov_kvcrush.methods.importance.PyramidKVConfig`);
            2 by default (the paper's preset: 7).
        quant: the store's settings: 4 bits by default (the paper's preset: 2); ``None`` keeps
            full precision, for ablations.
    """

    name: ClassVar[str] = "minikv"
    departure: ClassVar[str] = "selects by SnapKV's window over a 4-bit store (`preset=paper`: H2O, 2 bits)"
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cuda": (FULL_PRECISION_STORE, ADAPTIVE_HEAD_BUDGETS, SPANS),
        "cpu-op": (ADAPTIVE_HEAD_BUDGETS,),
        "gpu-plugin": (ADAPTIVE_HEAD_BUDGETS, SPANS),
        "gpu-pool": (ADAPTIVE_HEAD_BUDGETS, SPANS),
    }
    #: the prefill selection is never revisited (see the module docstring)
    frozen_selection: ClassVar[bool] = True
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {
            "selection": "h2o",
            "pyramid_depth": 7.0,
            "sink_tokens": 0,
            "quant": QuantSettings(bits=2, prompt_tail=0),
        }
    }
    selection: str = "snapkv"
    pyramid_depth: float = 2.0
    quant: QuantSettings | None = field(default_factory=lambda: QuantSettings(bits=4))
