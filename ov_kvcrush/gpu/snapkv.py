"""SnapKV's selection on the GPU path (``plugins/gpu/kernels/snapkv.cl``), as the reference takes
it (:func:`ov_kvcrush.methods.selection.pool_scores`, ``attention.group_heads``,
``selection.keep_indices``).

The window's per-query-head scores are pooled along tokens and summed per KV head, and each KV
head keeps its sinks, its recent tokens and the ``budget - sinks - recent`` highest pooled scores
between (``kvcrush.cl``'s rank rule: ties go to the earlier token). H2O and PyramidKV select the
same way over unpooled scores (``width=1``). A decode's layer cache lists the kept slots on the
device from the decisions (``kept_slots``) and gathers them there: nothing of the selection comes
back to the host (:class:`~ov_kvcrush.gpu.pool.SlotPositions`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.gpu.device import KernelDevice, device
from ov_kvcrush.gpu.kvcrush import top_mask
from ov_kvcrush.validation import check_choice, check_int

#: ``methods.selection.POOLS``, which this torch-free module cannot import (the worker has no torch)
POOLS = ("max", "avg")


def snapkv_keep(
    scores: np.ndarray,
    kv_heads: int,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    *,
    width: int = 1,
    pool: str = "max",
    sub_group: int | None = None,
) -> list[np.ndarray]:
    """Per KV head, the ascending tokens kept of the ``n`` scored by ``scores`` ``[Hq, n]``
    (``budget < n``; ``width``: the odd pooling width, 1 for none)."""
    hq, n = scores.shape
    check_choice("pool", pool, POOLS)
    check_int("width", width, 1, 129)
    if width % 2 == 0:
        raise ConfigError("width", width, "an odd integer in [1, 129]")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or hq % kv_heads:
        raise ConfigError("kv_heads", kv_heads, f"a divisor of the {hq} query heads")
    check_int("budget", budget, sink_tokens + recent_tokens, n - 1)
    dev = device(sub_group)
    scores_b = dev.to_device(scores.astype(np.float32))
    decisions, mid = launch_keep(dev, scores_b, n, n, hq // kv_heads, kv_heads, budget, sink_tokens, recent_tokens,
                                 width, pool)  # fmt: skip
    chosen = dev.to_host(decisions, np.uint8, (kv_heads, mid)) if mid > 0 else np.zeros((kv_heads, 0), np.uint8)
    return kept_tokens(chosen, n, sink_tokens, recent_tokens)


def launch_keep(
    dev: KernelDevice,
    scores: Any,
    stride: int,
    n: int,
    group: int,
    kv_heads: int,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    width: int = 1,
    pool: str = "max",
) -> tuple[Any, int]:
    """Enqueue the selection over device ``scores`` ``[Hq, stride]`` (their first ``n`` slots):
    the device buffer of each KV head's decisions ``[kv, mid]`` (uchar) on its middle tokens,
    and ``mid``."""
    i32 = np.int32
    pooled = dev.empty(4 * kv_heads * n)
    kernel = dev.kernel("snapkv.cl", "pooled_group_scores", {})
    dev.run(kernel, (n, kv_heads), None, scores, i32(stride), i32(n), i32(group), i32(width), i32(pool == "avg"),
            pooled)  # fmt: skip
    mid = n - sink_tokens - recent_tokens
    heavy = budget - sink_tokens - recent_tokens
    return top_mask(dev, pooled, kv_heads, n, sink_tokens, mid, heavy), mid


def kept_tokens(decisions: np.ndarray, n: int, sink_tokens: int, recent_tokens: int) -> list[np.ndarray]:
    """Per KV head, its sinks, the middle tokens its ``decisions`` ``[kv, mid]`` keep and its recent
    tokens, ascending."""
    sinks, recent = np.arange(sink_tokens), np.arange(n - recent_tokens, n)
    return [np.concatenate([sinks, np.flatnonzero(row) + sink_tokens, recent]) for row in decisions]
