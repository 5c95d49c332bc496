"""Prompt attention on the GPU path (``plugins/gpu/kernels/prefill.cl``): a step's query rows over
every slot of their KV head at or before their position, and the per-slot column sums of the
last ``window`` rows' probabilities that the methods score by (SnapKV's window; H2O's all rows)."""

from __future__ import annotations

import numpy as np

from ov_kvcrush.gpu.device import device, round_up
from ov_kvcrush.gpu.layout import PoolShape, check_tables


def paged_prefill(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    positions: np.ndarray,
    q: np.ndarray,
    qpos0: int,
    scale: float,
    window: int = 0,
    sub_group: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention of ``q`` ``[Hq, rows, D]`` (positions ``qpos0 ..``) over each KV head's slots
    (``lengths[kv]`` of them, at ``positions[kv]``): the output ``[Hq, rows, D]``, each row's
    log-sum-exp ``[Hq, rows]``, and each slot's probability summed over the last ``window`` rows
    ``[Hq, max slots]`` (zeros when ``window`` is 0)."""
    check_tables("tables", tables, lengths, shape.block_size, pool.nbytes, shape.block_bytes)
    dev = device(sub_group)
    hq, rows, d = q.shape
    sg = dev.sub_group
    i32, f32 = np.int32, np.float32
    kernel = {name: dev.kernel("prefill.cl", name, shape.constants()) for name in ("paged_prefill", "window_scores")}
    pool_b = dev.to_device(pool.view(np.uint8))
    tables_b, lengths_b = dev.to_device(tables.astype(np.int32)), dev.to_device(lengths.astype(np.int32))
    pos_b = dev.to_device(positions.astype(np.int32))
    q_b = dev.to_device(q.astype(np.float32))
    out_b, lse_b = dev.empty(4 * q.size), dev.empty(4 * hq * rows)
    common = (
        pool_b,
        tables_b,
        i32(tables.shape[1]),
        lengths_b,
        pos_b,
        i32(positions.shape[1]),
        q_b,
        i32(rows),
        i32(qpos0),
        f32(scale),
    )
    dev.run(kernel["paged_prefill"], (round_up(rows, sg), hq), (sg, 1), *common, out_b, lse_b)
    slots = max(int(lengths.max()), 1)
    scores_b = dev.to_device(np.zeros((hq, slots), np.float32))
    if window:
        dev.run(kernel["window_scores"], (slots, hq), None, *common, lse_b, i32(window), scores_b, i32(slots))
    return (
        dev.to_host(out_b, np.float32, (hq, rows, d)),
        dev.to_host(lse_b, np.float32, (hq, rows)),
        dev.to_host(scores_b, np.float32, (hq, slots)),
    )
