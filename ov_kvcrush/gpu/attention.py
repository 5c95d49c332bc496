"""Paged decode attention on the GPU path: one query token per KV head's own block tables, over
its 2-bit slots (``quant2.cl``) and then its full-precision slots (``paged_attention.cl``), with
the output and the probabilities the methods score by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import HeadsOnDevice, KernelDevice, device, round_up
from ov_kvcrush.gpu.layout import PoolShape, QuantShape, check_tables


@dataclass
class HeadTables:
    """Per KV head: its block ids (``[kv_heads, max_blocks]``) and token counts (``[kv_heads]``)."""

    tables: np.ndarray
    lengths: np.ndarray


@dataclass
class DecodeBuffers:
    """One step's device buffers: the query, the logits and probabilities ``[Hq, stride]`` (a
    head's 2-bit slots first), the output, and where each head's full-precision slots start."""

    q: Any
    logits: Any
    probs: Any
    out: Any
    first: Any
    stride: np.int32


def _slot_map(slots: list[np.ndarray] | None, heads: int) -> tuple[np.ndarray, int]:
    """The slots each head attends, padded to a ``[heads, width]`` table (width 0: no list)."""
    width = max((len(s) for s in slots), default=0) if slots is not None else 0
    table = np.zeros((heads, max(width, 1)), np.int32)
    for h, s in enumerate(slots or []):
        table[h, : len(s)] = s
    return table, width


@dataclass
class QuantHeads:
    """The 2-bit store's blocks of one layer as the decode reads them: the quantized pool's device
    buffer, the per-KV-head block tables ``[kv, table_stride]`` and 2-bit token counts ``[kv]``."""

    shape: QuantShape
    pool: Any
    tables: Any
    table_stride: int
    lengths: Any
    longest: int


def launch_quant_logits(
    dev: KernelDevice, quant: QuantHeads, bufs: DecodeBuffers, hq: int, scale: float
) -> tuple[Any, Any, tuple[Any, np.int32], Any]:
    """Enqueue the 2-bit slots' logits; returns what their values pass needs (kernel, pool,
    tables, lengths: :func:`launch_decode`'s ``quant_pass``)."""
    width = round_up(max(quant.longest, 1), dev.sub_group)
    consts = quant.shape.constants()
    stride = np.int32(quant.table_stride)
    dev.run(dev.kernel("quant2.cl", "quant_logits", consts), (width, hq), (dev.sub_group, 1), quant.pool,
            quant.tables, stride, quant.lengths, bufs.q, np.float32(scale), bufs.logits, bufs.stride)  # fmt: skip
    return dev.kernel("quant2.cl", "quant_values", consts), quant.pool, (quant.tables, stride), quant.lengths


def _quant_logits(
    dev: KernelDevice, quant: tuple[QuantShape, np.ndarray, HeadTables], bufs: DecodeBuffers, hq: int, scale: float
) -> tuple[Any, Any, tuple[Any, np.int32], Any]:
    """The 2-bit slots' logits over numpy tables and pool (uploaded)."""
    shape, pool, heads = quant
    on_device = QuantHeads(shape, dev.to_device(pool.view(np.uint8)), dev.to_device(heads.tables.astype(np.int32)),
                           heads.tables.shape[1], dev.to_device(heads.lengths.astype(np.int32)),
                           int(heads.lengths.max()))  # fmt: skip
    return launch_quant_logits(dev, on_device, bufs, hq, scale)


def paged_decode(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    q: np.ndarray,
    scale: float,
    sub_group: int | None = None,
    quant: tuple[QuantShape, np.ndarray, HeadTables] | None = None,
    slots: list[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One decode step's attention of query ``q`` ``[Hq, D]`` over the full-precision pool
    (bytes, blocks of ``shape``) by per-KV-head block ``tables`` ``[Hkv, max_blocks]`` and token
    ``lengths`` ``[Hkv]``, after each head's 2-bit slots when ``quant`` (its shape, pool and
    tables) is given. ``slots``: each KV head attends these slots of its blocks instead, in this
    order (ClusterKV's sinks, recalled and pending slots). Returns the output ``[Hq, D]`` and the
    probabilities ``[Hq, slots]`` (a head's 2-bit slots first, then the rest; 0 past its count):
    the scores the methods accumulate."""
    held = lengths
    if slots is not None:
        held = np.array([int(s.max()) + 1 if len(s) else 0 for s in slots])
        lengths = np.array([len(s) for s in slots], np.int32)
    check_tables("tables", tables, held, shape.block_size, pool.nbytes, shape.block_bytes)
    if quant:
        qs, qpool, qheads = quant
        check_tables("quant tables", qheads.tables, qheads.lengths, qs.block_size, qpool.nbytes, qs.block_bytes)
    dev = device(sub_group)
    hq, d = q.shape
    sg = dev.sub_group
    qlengths = quant[2].lengths.astype(np.int32) if quant else np.zeros(len(lengths), np.int32)
    totals = qlengths + lengths.astype(np.int32)
    width = max(int(totals.max()), 1)
    stride = round_up(width, sg)
    bufs = decode_buffers(dev, dev.to_device(q.astype(np.float32)), hq, d, width, dev.to_device(qlengths))
    quant_pass = _quant_logits(dev, quant, bufs, hq, scale) if quant else None
    slot_map, map_width = _slot_map(slots, len(lengths))
    heads = HeadsOnDevice(
        pool=dev.to_device(pool.view(np.uint8)),
        tables=dev.to_device(tables.astype(np.int32)),
        table_stride=tables.shape[1],
        lengths=dev.to_device(lengths.astype(np.int32)),
    )
    launch_decode(dev, shape, heads, bufs, hq, int(lengths.max()), dev.to_device(totals), scale,
                  (dev.to_device(slot_map), map_width), quant_pass)  # fmt: skip
    return dev.to_host(bufs.out, np.float32, (hq, d)), dev.to_host(bufs.probs, np.float32, (hq, stride))[:, :width]


def decode_buffers(
    dev: KernelDevice, q: Any, hq: int, d: int, width: int, first: Any, ragged: bool = True, values: bool = True
) -> DecodeBuffers:
    """A step's buffers for ``hq`` query heads over at most ``width`` slots (device query ``q``):
    the probabilities zero past each head's slots where the heads hold different counts
    (``ragged``; else every read column is written), no output where no values are read."""
    stride = round_up(max(width, 1), dev.sub_group)
    probs = dev.zeros(4 * hq * stride) if ragged else dev.empty(4 * hq * stride)
    out = dev.zeros(4 * hq * d) if values else dev.empty(4)
    return DecodeBuffers(q=q, logits=dev.empty(4 * hq * stride), probs=probs, out=out, first=first,
                         stride=np.int32(stride))  # fmt: skip


def launch_decode(
    dev: KernelDevice,
    shape: PoolShape,
    heads: HeadsOnDevice,
    bufs: DecodeBuffers,
    hq: int,
    longest: int,
    totals: Any,
    scale: float,
    slot_map: tuple[Any, int],
    quant_pass: tuple[Any, Any, tuple[Any, np.int32], Any] | None = None,
    values: bool = True,
) -> None:
    """Enqueue a decode step over ``heads``' full-precision slots (``longest``: the most any head
    attends; ``totals``: each head's slots, 2-bit ones included; ``slot_map``: the slot lists and
    their width, 0 for none), after the 2-bit slots' logits when ``quant_pass`` is given;
    ``values=False``: the probabilities only (the keys read, not the values)."""
    sg = dev.sub_group
    fp = (heads.pool, heads.tables, np.int32(heads.table_stride), heads.lengths, bufs.first, slot_map[0],
          np.int32(slot_map[1]))  # fmt: skip
    consts = shape.constants()
    dev.run(dev.kernel("paged_attention.cl", "paged_logits", consts), (round_up(max(longest, 1), sg), hq), (sg, 1),
            *fp, bufs.q, np.float32(scale), bufs.logits, bufs.stride)  # fmt: skip
    dev.run(dev.kernel("paged_attention.cl", "paged_softmax", consts), (sg, hq), (sg, 1), bufs.logits, bufs.stride,
            totals, bufs.probs)  # fmt: skip
    d = shape.head_dim
    if not values:
        return
    if quant_pass:
        kernel, qpool_b, (qtables_b, qstride), qlengths_b = quant_pass
        dev.run(kernel, (d, hq), (sg, 1), qpool_b, qtables_b, qstride, qlengths_b, bufs.probs, bufs.stride, bufs.out)
    dev.run(dev.kernel("paged_attention.cl", "paged_values", consts), (d, hq), (sg, 1), *fp, bufs.probs,
            bufs.stride, np.int32(quant_pass is not None), bufs.out)  # fmt: skip
