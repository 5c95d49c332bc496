"""A decode step's method work launched once over the step's sequences (``ov_kvcrush/gpu/step_work.py``,
``paged_store.cl``'s ``step_*``), against the one-sequence kernels it replaces on the GPU plugin's
path (``add_step_logits``, ``key_norm_scores``, ``drop_lowest``, ``drop_slot``, and after a 2-bit
flush ``zero_slot`` then ``gather_rows`` in the store's order, as ``quant_cache._flushed`` orders
it, where the launch's ``step_quant_store`` puts them): six sequences of different lengths in one
launch, each with its own part of the work, and the same sequences again through the one-sequence
kernels. Oracle: those kernels' slots, positions and scores, read back. Run in the ``gpu_worker``
(Intel's OpenCL CPU runtime)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK, HEAD_DIM, KV, GROUP = 16, 32, 2, 3
#: per sequence: slots held after the step's token, and its work: "lowest" (its probabilities,
#: then the lowest middle slot dropped; two sequences do, each reading its own), "add" (the
#: probabilities, its newest slot new), "norms" (Knorm's new key norm, then slot 4 dropped, as
#: StreamingLLM drops its oldest), "flush" (a 2-bit flush of the 16 slots after 5 pinned ones, over
#: 32 quantized slots, then the probabilities; 3 slots after the chunk, which move down, in the second)
SEQUENCES = [(23, "add"), (41, "lowest"), (70, "norms"), (21, "flush"), (37, "lowest"), (24, "flush")]
SINKS, RECENT, QUANTIZED, PINNED, FLUSHED = 4, 6, 32, 5, 16


@dataclass
class Sequence:
    """One sequence twice: the launch's layer and scores (``a``), the one-sequence kernels' (``b``)."""

    held: int
    kind: str
    a: Any
    a_scores: Any
    b: Any
    b_scores: Any
    stride: int
    before: np.ndarray


def _sequence(pool: Any, rng: np.random.Generator, held: int, kind: str) -> Sequence:
    """Two layers holding the same ``held`` random tokens (positions from 7, the last one's not
    yet written: a decode step's), and the same scores ``[Hq, stride]`` in two states."""
    from ov_kvcrush.gpu.pool import PagedLayer

    hq, stride = KV * GROUP, QUANTIZED + held + 3
    k, v = (rng.standard_normal((KV, held, HEAD_DIM)).astype(np.float32) for _ in range(2))
    scores = rng.random((hq, stride)).astype(np.float32)
    made = []
    for _ in range(2):
        lay = PagedLayer(pool, KV, hq)
        lay.append(k[:, :-1], v[:, :-1], 7)
        lay.append(k[:, -1:], v[:, -1:], 7 + held - 1)
        state = pool.slot_state(scores.nbytes)
        pool.dev.copy_bytes(pool.dev.to_device(scores), state.buffer, scores.nbytes, 0)
        made += [lay, state]
    return Sequence(held, kind, *made, stride, scores)


def _read(pool: Any, lay: Any, scores: Any, stride: int) -> dict:
    n = lay.held
    return {
        "keys": pool.dev.to_host(lay.read_keys(0, n), np.float32, (KV, n, HEAD_DIM)),
        "values": pool.dev.to_host(lay.read_values(0, n), np.float32, (KV, n, HEAD_DIM)),
        "positions": lay.positions.copy(),
        "scores": pool.dev.to_host(scores.buffer, np.float32, (KV * GROUP, stride)),
        "blocks": [len(t) for t in lay.tables],
    }


def _launch(pool: Any, seqs: list[Sequence], logits: Any, width: int) -> None:
    """Every sequence's work in one launch a kernel (``a``)."""
    from ov_kvcrush.gpu.layout import QuantShape
    from ov_kvcrush.gpu.step_work import DROP_LOWEST, StepLogitRows, StepTables, StepWork, launch_step_work

    works = []
    for q in seqs:
        w = StepWork(q.a, q.a_scores, q.stride, held=q.held)
        if q.kind in ("lowest", "add"):
            w.add_from, w.scored = q.held - (q.kind == "add"), q.held
        if q.kind == "lowest":
            w.drop_one(DROP_LOWEST, SINKS, q.held - SINKS - RECENT)
        if q.kind == "norms":
            w.norms_from = q.held - 1
            w.drop_one(SINKS, host_dropped=np.full(KV, SINKS))
        if q.kind == "flush":
            w.flushed(QUANTIZED, PINNED, FLUSHED)
            if q.held > PINNED + FLUSHED:
                w.drop_flushed(PINNED, FLUSHED)
            else:
                q.a.keep_first(PINNED)
            w.add_from, w.scored = QUANTIZED + q.held - 1, QUANTIZED + q.held
            w.quant_store(QUANTIZED + FLUSHED, q.a.held, None, False)  # its scores in the store's order
        works.append(w)
    # rows for 3 sequences more than the step's, empty, as a step shown at a padded size has them
    shown = len(seqs) + 3
    tables = np.zeros((shown * KV, max(len(t) for q in seqs for t in q.a.tables)), np.int32)
    for s, q in enumerate(seqs):
        for h, t in enumerate(q.a.tables):
            tables[s * KV + h, : len(t)] = t
    # the 2-bit store's tables and blocks (a flush alone moves none)
    quant = {"quant": pool.dev.to_device(np.zeros((shown * KV, 2), np.int32)), "quant_stride": 2,
             "quant_blocks": pool.quant_blocks(QuantShape(FLUSHED, HEAD_DIM, 16, 2, 2, GROUP))}  # fmt: skip
    step_tables = StepTables(pool.dev.to_device(tables), shown * KV, tables.shape[1], KV, **quant)
    launch_step_work(pool, 0, works, step_tables, StepLogitRows(logits, width, len(seqs)), GROUP)


def _one_by_one(pool: Any, seqs: list[Sequence], logits: Any, width: int) -> None:
    """Each sequence's work through the one-sequence kernels (``b``)."""
    dev, i32, hq = pool.dev, np.int32, KV * GROUP

    def kernel(name: str) -> Any:
        return dev.kernel("snapkv.cl", name, {})

    for s, q in enumerate(seqs):
        scored = QUANTIZED + q.held
        if q.kind in ("lowest", "add"):
            dev.run(kernel("add_step_logits"), (q.held, hq), None, q.b_scores.buffer, i32(q.stride),
                    i32(q.held - (q.kind == "add")), logits, i32(width), i32(len(seqs)), i32(s))  # fmt: skip
        if q.kind == "lowest":
            dropped = dev.empty(4 * KV)
            dev.run(kernel("drop_lowest"), (dev.sub_group, KV), (dev.sub_group, 1), q.b_scores.buffer,
                    i32(q.stride), i32(GROUP), i32(SINKS), i32(q.held - SINKS - RECENT), dropped)  # fmt: skip
            q.b.drop_one(dropped, (q.b_scores.buffer, q.stride))
        if q.kind == "flush":
            _reorder_after_flush(pool, q)
            dev.run(kernel("add_step_logits"), (scored, hq), None, q.b_scores.buffer, i32(q.stride), i32(scored),
                    logits, i32(width), i32(len(seqs)), i32(s))  # fmt: skip
        if q.kind == "norms":
            q.b.key_norms(q.held - 1, 1, q.b_scores.buffer, q.stride)
            q.b.drop_one(dev.to_device(np.full(KV, SINKS, np.int32)), (q.b_scores.buffer, q.stride),
                         np.full(KV, SINKS))  # fmt: skip


def _reorder_after_flush(pool: Any, q: Sequence) -> None:
    """The one-sequence path after a flush of the slots after the pinned ones (``quant_cache``'s
    ``_zero_new_score`` then ``_flushed``): the step's token from zero, the scores gathered in the
    store's order (the quantized slots', the chunk's, the pinned slots', those after the chunk),
    and the full-precision slots but the chunk's gathered into fresh blocks."""
    dev, i32, hq = pool.dev, np.int32, KV * GROUP
    scored = QUANTIZED + q.held
    dev.run(dev.kernel("snapkv.cl", "zero_slot", {}), (hq,), None, q.b_scores.buffer, i32(q.stride), i32(scored - 1))
    from ov_kvcrush.gpu.slots import KeptSlots

    fp = np.concatenate([np.arange(PINNED), np.arange(PINNED + FLUSHED, q.held)]).astype(np.int32)
    order = np.concatenate([np.arange(QUANTIZED), QUANTIZED + PINNED + np.arange(FLUSHED), QUANTIZED + fp])
    out = dev.empty(4 * hq * q.stride)
    dev.run(dev.kernel("snapkv.cl", "gather_rows", {}), (q.stride, hq), None, q.b_scores.buffer, i32(q.stride),
            dev.to_device(order.astype(np.int32)), i32(0), i32(scored), i32(GROUP), out, i32(q.stride))  # fmt: skip
    dev.copy_bytes(out, q.b_scores.buffer, 4 * hq * q.stride, 0)
    host = np.ascontiguousarray(np.broadcast_to(fp, (KV, len(fp))))
    q.b.keep(KeptSlots(dev.to_device(fp), 0, len(fp), host))  # the full-precision slots kept: gathered


def _launch_both() -> list[tuple[dict, dict, np.ndarray]]:
    """Per sequence: its state after the launch over the six, after the one-sequence kernels,
    and its scores before."""
    from ov_kvcrush.gpu.layout import PoolShape
    from ov_kvcrush.gpu.pool import DevicePool

    pool = DevicePool(PoolShape("f32", BLOCK, HEAD_DIM, GROUP), 400)
    rng = np.random.default_rng(3)
    seqs = [_sequence(pool, rng, held, kind) for held, kind in SEQUENCES]
    width, hq = max(QUANTIZED + held for held, _ in SEQUENCES), KV * GROUP
    logits = pool.dev.to_device(rng.standard_normal(hq * len(seqs) * (width + 1)).astype(np.float32))
    _launch(pool, seqs, logits, width)
    _one_by_one(pool, seqs, logits, width)
    out = []
    for q in seqs:
        got, want = _read(pool, q.a, q.a_scores, q.stride), _read(pool, q.b, q.b_scores, q.stride)
        if q.kind == "flush":  # the scores past those of the store's slots are nobody's
            for d in (got, want):
                d["scores"] = d["scores"][:, : QUANTIZED + q.held]
        out.append((got, want, q.before))
    return out


def test_one_launch_over_the_steps_sequences_does_each_ones_work_as_the_one_sequence_kernels(gpu_worker):
    """Each sequence's slots (keys and values), positions, blocks and scores after the launch over
    the six equal those after its own kernels (for a flush: the scores in the store's order); and
    each sequence's work did change its scores (the oracle is not the state before)."""
    got = gpu_worker.submit(_launch_both).result(timeout=600)
    for (held, kind), (batched, alone, before) in zip(SEQUENCES, got, strict=True):
        for key, want in alone.items():
            np.testing.assert_allclose(batched[key], want, rtol=1e-6, atol=1e-7, err_msg=f"{kind} {key}")
        assert not np.allclose(alone["scores"], before[:, : alone["scores"].shape[1]]), kind
        if kind in ("lowest", "norms"):
            assert alone["positions"].shape[1] == held - 1, kind  # one slot a head dropped
