"""Prefill attention at full speed: the prompt attending itself, causally, in the model's dtype.

The reference (:func:`ov_kvcrush.methods.attention.attend`) computes in float32 with an explicit
mask, chunk by chunk: exact, and what this is tested against, but on a GPU a 32k prompt then takes
~70 s where transformers' own ``sdpa`` takes 1.5 s. Here:

* no scores asked: torch's fused ``scaled_dot_product_attention(is_causal=True)`` (flash
  attention on CUDA, grouped-query heads read in place), on every device;
* per-head scores asked (H2O, MiniKV, KVCrush on H2O): the Triton kernel
  :func:`~ov_kvcrush.kernels.flash_scores.flash_attention_with_scores` where Triton runs (see
  :func:`~ov_kvcrush.kernels.use_triton`); elsewhere ``None``, and the caller runs the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ov_kvcrush.kernels import use_triton

# Imported where used, inside functions: what pulls in triton, heavy to import, so that importing
# this module stays light.


def causal_prefill(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None,
    *,
    return_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Attention of a whole prompt over itself: ``queries`` ``[b, hq, n, d]`` at the positions of
    ``keys``/``values`` ``[b, hk, n, d]``. Returns ``(output, scores or None)``, scores ``[b, hq, n]``
    float32 summed over every query row; ``None`` when no fast path applies here."""
    hq, hk = queries.shape[1], keys.shape[1]
    if queries.shape[2] != keys.shape[2] or hq % hk:
        return None
    if return_scores:
        if not use_triton(queries.device):
            return None
        from ov_kvcrush.kernels.flash_scores import flash_attention_with_scores

        return flash_attention_with_scores(queries, keys, values, scale)
    out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=hq != hk)
    return out, None
