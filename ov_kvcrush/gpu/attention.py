"""Paged decode attention on the GPU path (``plugins/gpu/kernels/paged_attention.cl``): one
query token per KV head's own block table, the output and the probabilities the methods score by."""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import device, round_up
from ov_kvcrush.gpu.layout import PoolShape


def paged_decode(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    q: np.ndarray,
    scale: float,
    sub_group: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One decode step's attention of query ``q`` ``[Hq, D]`` over the pool (bytes, blocks of
    ``shape``) by per-KV-head block ``tables`` ``[Hkv, max_blocks]`` and token ``lengths``
    ``[Hkv]``. Returns the output ``[Hq, D]`` and the probabilities ``[Hq, max(lengths)]`` (0 past
    a head's length): the scores the methods accumulate."""
    dev = device(sub_group)
    hq, d = q.shape
    consts = shape.constants()
    width = max(int(lengths.max()), 1)
    stride = round_up(width, dev.sub_group)
    pool_b = dev.to_device(pool.view(np.uint8))
    tables_b = dev.to_device(tables.astype(np.int32))
    lengths_b = dev.to_device(lengths.astype(np.int32))
    q_b = dev.to_device(q.astype(np.float32))
    logits_b = dev.empty(4 * hq * stride)
    probs = np.zeros((hq, stride), dtype=np.float32)
    probs_b = dev.to_device(probs)
    out_b = dev.empty(4 * hq * d)
    i32, f32 = np.int32, np.float32
    sg = dev.sub_group

    def kernel(name: str) -> Any:
        return dev.kernel("paged_attention.cl", name, consts)

    dev.run(
        kernel("paged_logits"),
        (stride, hq),
        (sg, 1),
        pool_b,
        tables_b,
        i32(tables.shape[1]),
        lengths_b,
        q_b,
        f32(scale),
        logits_b,
        i32(stride),
    )
    dev.run(kernel("paged_softmax"), (sg, hq), (sg, 1), logits_b, i32(stride), lengths_b, probs_b)
    dev.run(
        kernel("paged_values"),
        (d, hq),
        (sg, 1),
        pool_b,
        tables_b,
        i32(tables.shape[1]),
        lengths_b,
        probs_b,
        i32(stride),
        out_b,
    )
    out = dev.to_host(out_b, np.float32, (hq, d))
    return out, dev.to_host(probs_b, np.float32, (hq, stride))[:, :width]
