"""SnapKV's selection on the GPU path (``plugins/gpu/kernels/snapkv.cl``), as the reference takes
it (:func:`ov_kvcrush.methods.selection.pool_scores`, ``attention.group_heads``,
``selection.keep_indices``).

The window's per-query-head scores are pooled along tokens and summed per KV head, and each KV
head keeps its sinks, its recent tokens and the ``budget - sinks - recent`` highest pooled scores
between (``kvcrush.cl``'s rank rule: ties go to the earlier token). H2O and PyramidKV select the
same way over unpooled scores (``width=1``). What comes back to the host is one byte per middle
token per KV head (its decision), from which the block tables are rewritten.
"""

from __future__ import annotations

import numpy as np

from ov_kvcrush.gpu.device import device

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
    checks = [
        ("pool", pool, pool in POOLS, "one of " + ", ".join(POOLS)),
        ("width", width, 1 <= width <= 129 and width % 2 == 1, "an odd integer in [1, 129]"),
        ("kv_heads", kv_heads, kv_heads >= 1 and hq % kv_heads == 0, f"a divisor of the {hq} query heads"),
        ("budget", budget, sink_tokens + recent_tokens <= budget < n, f"in [{sink_tokens + recent_tokens}, {n - 1}]"),
    ]
    for name, value, ok, allowed in checks:  # plain ValueErrors: they cross the worker's process boundary
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")
    dev = device(sub_group)
    i32 = np.int32
    pooled = dev.empty(4 * kv_heads * n)
    kernel = dev.kernel("snapkv.cl", "pooled_group_scores", {})
    dev.run(kernel, (n, kv_heads), None, dev.to_device(scores.astype(np.float32)), i32(n), i32(hq // kv_heads),
            i32(width), i32(pool == "avg"), pooled)  # fmt: skip
    mid = n - sink_tokens - recent_tokens
    heavy = budget - sink_tokens - recent_tokens
    decisions = dev.empty(max(kv_heads * mid, 1))
    if mid > 0:
        top = dev.kernel("kvcrush.cl", "head_decisions_topk", {})
        dev.run(top, (mid, kv_heads), None, pooled, i32(n), i32(sink_tokens), i32(mid), i32(heavy), decisions)
    chosen = dev.to_host(decisions, np.uint8, (kv_heads, mid)) if mid > 0 else np.zeros((kv_heads, 0), np.uint8)
    sinks, recent = np.arange(sink_tokens), np.arange(n - recent_tokens, n)
    return [np.concatenate([sinks, np.flatnonzero(row) + sink_tokens, recent]) for row in chosen]
