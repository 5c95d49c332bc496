"""Paged decode attention on the GPU path: one query token per KV head's own block tables, over
its 2-bit slots (``quant2.cl``) and then its full-precision slots (``paged_attention.cl``), with
the output and the probabilities the methods score by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import Device, device, round_up
from ov_kvcrush.gpu.layout import PoolShape, QuantShape, check_tables


@dataclass
class HeadTables:
    """Per KV head: its block ids (``[kv_heads, max_blocks]``) and token counts (``[kv_heads]``)."""

    tables: np.ndarray
    lengths: np.ndarray


def _tables(dev: Device, heads: HeadTables) -> tuple[Any, Any, np.int32]:
    return (
        dev.to_device(heads.tables.astype(np.int32)),
        dev.to_device(heads.lengths.astype(np.int32)),
        np.int32(heads.tables.shape[1]),
    )


def paged_decode(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    lengths: np.ndarray,
    q: np.ndarray,
    scale: float,
    sub_group: int | None = None,
    quant: tuple[QuantShape, np.ndarray, HeadTables] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One decode step's attention of query ``q`` ``[Hq, D]`` over the full-precision pool
    (bytes, blocks of ``shape``) by per-KV-head block ``tables`` ``[Hkv, max_blocks]`` and token
    ``lengths`` ``[Hkv]``, after each head's 2-bit slots when ``quant`` (its shape, pool and
    tables) is given. Returns the output ``[Hq, D]`` and the probabilities ``[Hq, slots]`` (a
    head's 2-bit slots first, then its full-precision ones; 0 past its count): the scores the
    methods accumulate."""
    check_tables("tables", tables, lengths, shape.block_size, pool.nbytes, shape.block_bytes)
    if quant:
        check_tables(
            "quant tables",
            quant[2].tables,
            quant[2].lengths,
            quant[0].block_size,
            quant[1].nbytes,
            quant[0].block_bytes,
        )
    dev = device(sub_group)
    hq, d = q.shape
    sg = dev.sub_group
    i32, f32 = np.int32, np.float32
    qlengths = quant[2].lengths.astype(np.int32) if quant else np.zeros_like(lengths, dtype=np.int32)
    totals = qlengths + lengths.astype(np.int32)
    width = max(int(totals.max()), 1)
    stride = round_up(width, sg)
    q_b = dev.to_device(q.astype(np.float32))
    logits_b = dev.empty(4 * hq * stride)
    probs_b = dev.to_device(np.zeros((hq, stride), dtype=np.float32))
    out_b = dev.to_device(np.zeros((hq, d), dtype=np.float32))
    if quant:
        qshape, qpool, qheads = quant
        qtables_b, qlengths_b, qstride = _tables(dev, qheads)
        qpool_b = dev.to_device(qpool.view(np.uint8))
        qwidth = round_up(max(int(qlengths.max()), 1), sg)

        def qkernel(name: str) -> Any:
            return dev.kernel("quant2.cl", name, qshape.constants())

        dev.run(
            qkernel("quant_logits"),
            (qwidth, hq),
            (sg, 1),
            qpool_b,
            qtables_b,
            qstride,
            qlengths_b,
            q_b,
            f32(scale),
            logits_b,
            i32(stride),
        )
    pool_b = dev.to_device(pool.view(np.uint8))
    tables_b, lengths_b, fstride = _tables(dev, HeadTables(tables, lengths))
    first_b = dev.to_device(qlengths)
    totals_b = dev.to_device(totals)

    def kernel(name: str) -> Any:
        return dev.kernel("paged_attention.cl", name, shape.constants())

    fwidth = round_up(max(int(lengths.max()), 1), sg)
    dev.run(
        kernel("paged_logits"),
        (fwidth, hq),
        (sg, 1),
        pool_b,
        tables_b,
        fstride,
        lengths_b,
        first_b,
        q_b,
        f32(scale),
        logits_b,
        i32(stride),
    )
    dev.run(kernel("paged_softmax"), (sg, hq), (sg, 1), logits_b, i32(stride), totals_b, probs_b)
    if quant:
        dev.run(
            qkernel("quant_values"),
            (d, hq),
            (sg, 1),
            qpool_b,
            qtables_b,
            qstride,
            qlengths_b,
            probs_b,
            i32(stride),
            out_b,
        )
    dev.run(
        kernel("paged_values"),
        (d, hq),
        (sg, 1),
        pool_b,
        tables_b,
        fstride,
        lengths_b,
        first_b,
        probs_b,
        i32(stride),
        i32(quant is not None),
        out_b,
    )
    out = dev.to_host(out_b, np.float32, (hq, d))
    return out, dev.to_host(probs_b, np.float32, (hq, stride))[:, :width]
