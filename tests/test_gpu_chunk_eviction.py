"""The 2-bit store's chunk eviction on the GPU path's device (``ov_kvcrush/gpu/quant_step.py``,
``paged_store.cl``'s ``step_quant_store``): the host counts what each head drops and which chunks may go,
the device chooses and moves them, nothing read back. Oracle: the reference's rule
(``keep_chunk_indices`` over the chunks' summed scores, as ``_evict_quantized_chunks`` sums them)
and its gather of the kept chunks' scores and 2-bit blocks. The kernel runs in the ``gpu_worker``
(Intel's OpenCL CPU runtime)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_kvcrush.gpu.quant_step import UNKNOWN, plan_chunk_eviction, positions_after
from ov_kvcrush.methods.selection import keep_chunk_indices

CHUNK, HEAD_DIM, KV, GROUP = 16, 32, 3, 2
SINKS, RECENT = 4, 20


def _positions(rng: np.random.Generator, chunks: int) -> tuple[np.ndarray, int]:
    """Each head's 2-bit slots' positions, ascending from 0 (a sink in the first chunk), some
    skipped (a selection's), and the newest token's position a little after them."""
    gaps = rng.integers(1, 4, (KV, chunks * CHUNK))
    gaps[:, 0] = 0
    pos = np.cumsum(gaps, axis=1).astype(np.int32)
    return pos, int(pos.max()) + int(rng.integers(1, RECENT))


def _reference_keep(sums: np.ndarray, qpos: np.ndarray, over: int, last_old: int) -> np.ndarray:
    return keep_chunk_indices(torch.from_numpy(sums)[None], torch.from_numpy(qpos)[None], over, SINKS,
                              last_old)[0].numpy()  # fmt: skip


def _chunk_sums(scores: np.ndarray, nq: int, by_layer: bool) -> np.ndarray:
    """``[kv, chunks]`` as the reference ranks: a KV head's query heads summed, then a chunk's slots."""
    grouped = scores[:, :nq].reshape(KV, GROUP, nq).sum(1)
    sums = grouped.reshape(KV, nq // CHUNK, CHUNK).sum(-1)
    return np.broadcast_to(sums.sum(0, keepdims=True), sums.shape).copy() if by_layer else sums


def test_the_host_counts_as_the_reference_and_knows_what_it_must_after_the_device_chose():
    """The host's count and runs of chunks that may go equal the reference's rule; after an
    eviction it no longer knows the middle's positions, and its next count (a flushed chunk later,
    the recent window moved on) is still the reference's with every position known."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        chunks, over = int(rng.integers(2, 12)), int(rng.integers(1, 4))
        qpos, newest = _positions(rng, chunks)
        sums = rng.random((KV, chunks)).astype(np.float32)
        keep = _reference_keep(sums, qpos, over, newest - RECENT)
        plan = plan_chunk_eviction(qpos, CHUNK, over, SINKS, newest - RECENT)
        dropped = chunks - keep.shape[1]
        assert (plan.drop if plan else 0) == dropped, trial
        if plan is None:
            continue
        for h in range(KV):  # the dropped chunks lie in the head's run
            gone = sorted(set(range(chunks)) - set(keep[h].tolist()))
            assert all(plan.ranges[h, 0] <= c < plan.ranges[h, 1] for c in gone), (trial, h)
        slots = (keep[:, :, None] * CHUNK + np.arange(CHUNK)).reshape(KV, -1)
        true = np.take_along_axis(qpos, slots, axis=1)
        known = positions_after(qpos, CHUNK, plan)
        assert ((known == true) | (known == UNKNOWN)).all(), trial
        # a chunk flushed later, the recent window moved on by it
        later = newest + CHUNK + int(rng.integers(0, 40))
        flushed = np.broadcast_to(np.arange(later - CHUNK + 1, later + 1, dtype=np.int32), (KV, CHUNK))
        true, known = np.concatenate([true, flushed], 1), np.concatenate([known, flushed], 1)
        for over_again in (1, 2):
            want = plan_chunk_eviction(true, CHUNK, over_again, SINKS, later - RECENT)
            got = plan_chunk_eviction(known, CHUNK, over_again, SINKS, later - RECENT)
            assert (want is None) == (got is None), trial
            if want is not None and got is not None:
                assert want.drop == got.drop and (want.ranges == got.ranges).all(), trial


def _evict_on_device(cases: list[dict]) -> list[dict]:
    """Each case's scores and 2-bit blocks in shared buffers (at their own offsets), evicted in one
    launch; what the device holds after."""
    from ov_kvcrush.gpu.layout import PoolShape, QuantShape
    from ov_kvcrush.gpu.pool import DevicePool
    from ov_kvcrush.gpu.quant_step import QuantStepBuffers, QuantStepRow, launch_quant_steps

    pool = DevicePool(PoolShape("f32", CHUNK, HEAD_DIM, GROUP), 8)
    dev, shape = pool.dev, QuantShape(CHUNK, HEAD_DIM, 16, 2, 2, GROUP)
    words = shape.block_bytes // 4
    scores = np.concatenate([c["scores"].ravel() for c in cases])
    tables = np.concatenate([c["table"].ravel() for c in cases])
    blocks = max(int(c["table"].max()) for c in cases) + 1
    before = np.random.default_rng(5).integers(0, 2**32, blocks * words, dtype=np.uint32)
    rows, at, table_at = [], 0, 0
    for c in cases:
        rows.append(QuantStepRow(at, c["scores"].shape[1], c["nq"], c["held"], None, c["plan"], table_at,
                                 c["table"].shape[1], c["by_layer"]))  # fmt: skip
        at, table_at = at + c["scores"].size, table_at + c["table"].size
    buffers = [dev.to_device(x) for x in (scores, tables, before)]
    launch_quant_steps(pool, QuantStepBuffers(*buffers, shape, KV, GROUP), rows)
    got_scores = dev.to_host(buffers[0], np.float32, scores.shape)
    got_blocks = dev.to_host(buffers[2], np.uint32, before.shape).reshape(blocks, words)
    out, at = [], 0
    for c in cases:
        out.append({"scores": got_scores[at : at + c["scores"].size].reshape(c["scores"].shape),
                    "blocks": got_blocks, "before": before.reshape(blocks, words)})  # fmt: skip
        at += c["scores"].size
    return out


def _case(rng: np.random.Generator, chunks: int, held: int, over: int, by_layer: bool, ties: bool, first: int) -> dict:
    nq = chunks * CHUNK
    qpos, newest = _positions(rng, chunks)
    scores = rng.random((KV * GROUP, nq + held + 5)).astype(np.float32)
    if ties:  # chunks 1 and 3 of every head alike and the lowest: the older goes first
        scores[:, CHUNK : 2 * CHUNK] *= 0.01
        scores[:, 3 * CHUNK : 4 * CHUNK] = scores[:, CHUNK : 2 * CHUNK]
    width = chunks + 3
    ids = rng.permutation(np.arange(first, first + KV * width)).reshape(KV, width).astype(np.int32)
    plan = plan_chunk_eviction(qpos, CHUNK, over, SINKS, newest - RECENT)
    assert plan is not None
    keep = _reference_keep(_chunk_sums(scores, nq, by_layer), qpos, over, newest - RECENT)
    return {"scores": scores, "table": ids, "plan": plan, "keep": keep, "nq": nq, "held": held, "by_layer": by_layer}


@pytest.mark.parametrize("by_layer", [False, True])
def test_the_device_keeps_the_reference_chunks_blocks_and_scores(gpu_worker, by_layer):
    """Three sequences in one launch (dropping 1, 2 and, past its runs, fewer chunks a head; one
    with tied chunks): each head's first blocks hold its kept chunks' words in order, its scores
    are the kept chunks' then the full-precision slots', zeros after; every head ranks by its
    own sums, or with layer scope by the layer's."""
    rng = np.random.default_rng(11 + by_layer)
    cases = [
        _case(rng, 9, 7, 1, by_layer, ties=True, first=0),
        _case(rng, 12, 40, 2, by_layer, ties=False, first=100),  # the full-precision slots move in rounds
        _case(rng, 4, 3, 9, by_layer, ties=False, first=200),  # asks more than its run holds
    ]
    got = gpu_worker.submit(_evict_on_device, cases).result(timeout=300)
    assert (cases[0]["keep"] == [0, *range(2, 9)]).all()  # the tie: chunk 1 went, 3 stayed
    for c, g in zip(cases, got, strict=True):
        keep, nq, held = c["keep"], c["nq"], c["held"]
        assert c["plan"].drop == nq // CHUNK - keep.shape[1]
        kept = keep.shape[1] * CHUNK
        for h in range(KV):
            slots = (keep[h][:, None] * CHUNK + np.arange(CHUNK)).ravel()
            for q in range(h * GROUP, (h + 1) * GROUP):
                want = np.concatenate([c["scores"][q, slots], c["scores"][q, nq : nq + held]])
                np.testing.assert_array_equal(g["scores"][q, : kept + held], want)
                assert not g["scores"][q, kept + held : nq + held].any()
            table = c["table"][h]
            np.testing.assert_array_equal(g["blocks"][table[: keep.shape[1]]], g["before"][table[keep[h]]])
        if by_layer:  # every head drops the same chunks
            assert (keep == keep[:1]).all()
