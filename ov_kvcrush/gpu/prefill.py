"""Prompt attention on the GPU path (``plugins/gpu/kernels/prefill.cl``): a step's query rows over
every slot of their KV head at or before their position, and the per-slot column sums of the
last ``window`` rows' probabilities that the methods score by (SnapKV's window; H2O's all rows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import HeadsOnDevice, KernelDevice, device, round_up
from ov_kvcrush.gpu.layout import PoolShape, check_tables


def launch_prompt(
    dev: KernelDevice,
    shape: PoolShape,
    heads: HeadsOnDevice,
    q: Any,
    hq: int,
    rows: int,
    qpos0: int,
    scale: float,
    window: int,
    slots: int,
) -> tuple[Any, Any, Any]:
    """Enqueue the attention of device ``q`` ``[hq, rows, D]`` over ``heads``; returns device buffers
    of the output, the rows' log-sum-exp and the window's per-slot sums ``[Hq, slots]`` (zeros
    when ``window`` is 0)."""
    sg = dev.sub_group
    i32, f32 = np.int32, np.float32
    kernel = {name: dev.kernel("prefill.cl", name, shape.constants()) for name in ("paged_prefill", "window_scores")}
    out_b, lse_b = dev.empty(4 * hq * rows * shape.head_dim), dev.empty(4 * hq * rows)
    common = (heads.pool, heads.tables, i32(heads.table_stride), heads.lengths, heads.positions,
              i32(heads.pos_stride), q, i32(rows), i32(qpos0), f32(scale))  # fmt: skip
    dev.run(kernel["paged_prefill"], (round_up(rows, sg), hq), (sg, 1), *common, out_b, lse_b)
    scores_b = dev.zeros(4 * hq * max(slots, 1))
    if window:
        dev.run(kernel["window_scores"], (max(slots, 1), hq), None, *common, lse_b, i32(window), scores_b,
                i32(max(slots, 1)))  # fmt: skip
    return out_b, lse_b, scores_b


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
    heads = HeadsOnDevice(
        pool=dev.to_device(pool.view(np.uint8)),
        tables=dev.to_device(tables.astype(np.int32)),
        table_stride=tables.shape[1],
        lengths=dev.to_device(lengths.astype(np.int32)),
        positions=dev.to_device(positions.astype(np.int32)),
        pos_stride=positions.shape[1],
    )
    slots = max(int(lengths.max()), 1)
    out_b, lse_b, scores_b = launch_prompt(dev, shape, heads, dev.to_device(q.astype(np.float32)), hq, rows, qpos0,
                                           scale, window, slots)  # fmt: skip
    return (
        dev.to_host(out_b, np.float32, (hq, rows, d)),
        dev.to_host(lse_b, np.float32, (hq, rows)),
        dev.to_host(scores_b, np.float32, (hq, slots)),
    )
