"""Writing and moving tokens in the GPU pool (``plugins/gpu/kernels/paged_store.cl``): a step's
new tokens stored at their slots in the CPU op's block layout, and the gather of kept slots
into fresh blocks that eviction uses."""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import KernelDevice, device
from ov_kvcrush.gpu.layout import PoolShape, check_tables


def store_constants(shape: PoolShape) -> dict[str, int]:
    """What ``paged_store.cl`` is built with (no query group: it moves tokens, not heads' scores)."""
    constants = shape.constants()
    return {k: constants[k] for k in ("KV_PRECISION", "BLOCK_SIZE", "HEAD_DIM")}


def launch_store(dev: KernelDevice, shape: PoolShape, pool: Any, tables: Any, table_stride: int, first: Any,
                 k: Any, v: Any, tokens: int, kv_heads: int) -> None:  # fmt: skip
    """Enqueue the store of ``tokens`` tokens per KV head (device buffers ``k``, ``v`` ``[kv, tokens,
    D]`` f32) at slots ``first[kv] + t`` of the heads' blocks in device ``pool``."""
    sg = dev.sub_group
    kernel = dev.kernel("paged_store.cl", "store_tokens", store_constants(shape))
    dev.run(kernel, (sg, tokens, kv_heads), (sg, 1, 1), pool, tables, np.int32(table_stride), first, k, v)


def launch_gather(dev: KernelDevice, shape: PoolShape, pool: Any, tables: Any, table_stride: int, new_tables: Any,
                  new_stride: int, src: Any, src_stride: int, counts: Any, kv_heads: int,
                  width: int | None = None) -> None:  # fmt: skip
    """Enqueue the gather of each KV head's ``src`` slots (rows ``src_stride`` apart: 0 when every
    head gathers one list; ``counts[kv]`` of them, at most ``width``, default ``src_stride``) to
    slots ``0 ..`` of its ``new_tables`` blocks, within one device ``pool`` (the kept slots'
    blocks and the new ones are disjoint)."""
    width = src_stride if width is None else width
    kernel = dev.kernel("paged_store.cl", "gather_slots", store_constants(shape))
    dev.run(kernel, (shape.head_dim + 4, max(width, 1), kv_heads), None, pool, tables, np.int32(table_stride),
            pool, new_tables, np.int32(new_stride), src, np.int32(src_stride), counts)  # fmt: skip


def store_tokens(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    first: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    sub_group: int | None = None,
) -> np.ndarray:
    """The pool with ``k``, ``v`` ``[kv_heads, tokens, D]`` written at slots ``first[kv] + t``
    of each KV head (its blocks a row of ``tables``)."""
    kv, tokens, _ = k.shape
    check_tables("tables", tables, first.astype(np.int64) + tokens, shape.block_size, pool.nbytes, shape.block_bytes)
    dev = device(sub_group)
    pool_b = dev.to_device(pool.view(np.uint8))
    launch_store(dev, shape, pool_b, dev.to_device(tables.astype(np.int32)), tables.shape[1],
                 dev.to_device(first.astype(np.int32)), dev.to_device(k.astype(np.float32)),
                 dev.to_device(v.astype(np.float32)), tokens, kv)  # fmt: skip
    return dev.to_host(pool_b, np.uint8, (pool.nbytes,))


def gather_slots(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    new_tables: np.ndarray,
    kept: list[np.ndarray],
    sub_group: int | None = None,
) -> np.ndarray:
    """The pool with each KV head's ``kept`` slots (in order) copied to slots ``0 ..`` of its
    blocks in ``new_tables`` (blocks none of ``tables`` holds)."""
    dev = device(sub_group)
    kv = len(kept)
    width = max(max((len(s) for s in kept), default=0), 1)
    src = np.zeros((kv, width), np.int32)
    for h, s in enumerate(kept):
        src[h, : len(s)] = s
    counts = np.array([len(s) for s in kept], np.int32)
    held = np.array([int(s.max()) + 1 if len(s) else 0 for s in kept])
    check_tables("tables", tables, held, shape.block_size, pool.nbytes, shape.block_bytes)
    check_tables("new_tables", new_tables, counts, shape.block_size, pool.nbytes, shape.block_bytes)
    pool_b = dev.to_device(pool.view(np.uint8))
    launch_gather(dev, shape, pool_b, dev.to_device(tables.astype(np.int32)), tables.shape[1],
                  dev.to_device(new_tables.astype(np.int32)), new_tables.shape[1], dev.to_device(src), width,
                  dev.to_device(counts), kv)  # fmt: skip
    return dev.to_host(pool_b, np.uint8, (pool.nbytes,))
