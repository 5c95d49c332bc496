"""The GPU path's OpenCL kernels (issue 49) on Intel's OpenCL CPU runtime, at sub-group sizes 8
and 16, against the torch reference and the CPU op.

Oracles: the reference attention (``methods.attention.attend``) over the tokens as the store
holds them, the CPU op's own decode output over the same tokens, and KVCrush's reference
(``methods.kvcrush``) step by step, whose integer outputs must be equal, not close. The kernels
run in a fresh worker process (``runtime.isolated``): this process has imported openvino, after
which Intel's runtime cannot load. Without the runtime the tests skip, naming what is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import HKV, HQ, D, op_model

from ov_kvcrush.gpu import attention, kvcrush, layout, runtime
from ov_kvcrush.methods import kvcrush as reference
from ov_kvcrush.methods.attention import attend
from ov_kvcrush.methods.selection import plan_spans

SUB_GROUPS = (8, 16)


@pytest.fixture(scope="module")
def gpu():
    with runtime.isolated() as worker:
        try:
            worker.submit(runtime.device_info).result()
        except runtime.GPUPathError as e:
            pytest.skip(str(e))
        yield worker


def reference_decode(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray]):
    """Each query head's output and probabilities over its KV head's stored tokens."""
    group = q.shape[0] // len(keys)
    outs, probs = [], []
    for h in range(q.shape[0]):
        k, v = keys[h // group], values[h // group]
        res = attend(
            torch.from_numpy(q[h][None, None, None]),
            torch.from_numpy(k[None, None]),
            torch.from_numpy(v[None, None]),
            q_positions=torch.tensor([k.shape[0]]),
            k_positions=torch.arange(k.shape[0]),
            return_scores=True,
        )
        outs.append(res.output[0, 0, 0].numpy())
        probs.append(res.scores[0, 0].numpy())
    return outs, probs


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize("precision", layout.PRECISIONS)
def test_paged_decode_is_the_reference_over_each_heads_stored_tokens(gpu, precision, sub_group):
    """Heads holding different token counts (as per-head eviction leaves them), their blocks at
    shuffled ids among garbage blocks, a partial last block: output and probabilities."""
    rng = np.random.default_rng(PRECISIONS_SEED[precision] + sub_group)
    shape = layout.PoolShape(precision, 32, 64, group=3)
    lengths = [100, 37, 64]
    keys = [rng.standard_normal((n, 64), dtype=np.float32) * 2 for n in lengths]
    values = [rng.standard_normal((n, 64), dtype=np.float32) for n in lengths]
    paged = layout.page_heads(shape, keys, values, rng)
    q = rng.standard_normal((9, 64), dtype=np.float32)
    out, probs = gpu.submit(
        attention.paged_decode, shape, paged.pool, paged.tables, paged.lengths, q, 64**-0.5, sub_group
    ).result()
    ref_out, ref_probs = reference_decode(
        q, [layout.stored(shape, k) for k in keys], [layout.stored(shape, v) for v in values]
    )
    for h in range(9):
        np.testing.assert_allclose(out[h], ref_out[h], rtol=1e-5, atol=1e-5)
        n = lengths[h // 3]
        np.testing.assert_allclose(probs[h, :n], ref_probs[h], rtol=1e-5, atol=1e-7)
        assert not probs[h, n:].any()


PRECISIONS_SEED = {"f32": 0, "f16": 100, "u8": 200}


@pytest.mark.parametrize("precision", ["f16", "u8"])
def test_paged_decode_equals_the_cpu_op_over_the_same_store(gpu, ov_core, precision):
    """The CPU op stores a prompt and a decode token; the GPU layout of the same vectors holds
    exactly what the op reads back, and the kernels' decode output is the op's."""
    from ov_kvcrush.op import kvcache

    rng = np.random.default_rng(7)
    n = 150
    q = rng.standard_normal((1, HQ, n + 1, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, n + 1, D), dtype=np.float32) * 3 + 1
    v = rng.standard_normal((1, HKV, n + 1, D), dtype=np.float32)
    pool = kvcache.KVPool(1, HQ, HKV, D, block_size=32, precision=precision)
    seq = pool.new_sequence()
    req = op_model(ov_core, HQ, HKV, D)
    for lo, hi in ((0, n), (n, n + 1)):
        feed = {"q": q[:, :, lo:hi], "k": k[:, :, lo:hi], "v": v[:, :, lo:hi], "kvc_sequence": np.array([seq.handle])}
        op_out = np.array(req.infer(feed)[0])[0, :, -1]
    shape = layout.PoolShape(precision, 32, D, group=HQ // HKV)
    for g in range(HKV):  # the same codes and scales: one u8 step is ~0.05 here, these are float rounding
        _pos, keys, values, _ = seq.read_head(0, g)
        np.testing.assert_allclose(keys, layout.stored(shape, k[0, g]), rtol=1e-6, atol=2e-6)
        np.testing.assert_allclose(values, layout.stored(shape, v[0, g]), rtol=1e-6, atol=2e-6)
    pool.close()
    paged = layout.page_heads(shape, list(k[0]), list(v[0]), rng)
    out, _ = gpu.submit(
        attention.paged_decode, shape, paged.pool, paged.tables, paged.lengths, q[0, :, -1], D**-0.5, 16
    ).result()
    np.testing.assert_allclose(out, op_out.reshape(HQ, D), rtol=1e-4, atol=1e-5)


def scores_with_ties(rng: np.random.Generator, h: int, n: int) -> np.ndarray:
    """Scores of few distinct values (exact in any summation order): ties everywhere, which the
    reference breaks toward the earlier token."""
    return rng.integers(0, 6, size=(h, n)).astype(np.float32)


KVCRUSH_CASES = [
    ("topk", ("random",), "tuple", "max_score"),
    ("topk", ("random", "mean"), "tuple", "first"),
    ("threshold", ("random", "zeros", "mean"), "nearest", "max_score"),
    ("threshold", ("alternating",), "tuple", "first"),
]


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize(("signature", "anchors", "multi", "representative"), KVCRUSH_CASES)
def test_kvcrush_steps_equal_the_reference(gpu, signature, anchors, multi, representative, sub_group):
    rng = np.random.default_rng(len(anchors) * 10 + sub_group)
    for h, n, budget, sinks, recent, reps in ((9, 300, 120, 4, 16, 40), (40, 257, 90, 0, 8, 50)):
        scores = scores_with_ties(rng, h, n)
        ref = reference.kvcrush_select(
            torch.from_numpy(scores)[None],
            budget,
            sinks,
            recent,
            reps,
            signature=signature,
            anchors=anchors,
            multi_anchor=multi,
            representative=representative,
        )[0]
        got = gpu.submit(
            kvcrush.kvcrush_select,
            scores,
            budget,
            sinks,
            recent,
            reps,
            anchor_bits=ref.anchors.numpy(),
            mean_anchor=tuple(a == "mean" for a in anchors),
            signature=signature,
            multi_anchor=multi,
            representative=representative,
            sub_group=sub_group,
        ).result()
        np.testing.assert_array_equal(got.evictable, ref.evictable.numpy())
        np.testing.assert_array_equal(got.important, np.sort(ref.important.numpy()))
        np.testing.assert_array_equal(got.signatures, reference.pack_signatures(ref.bits).numpy())
        np.testing.assert_array_equal(got.anchors, reference.pack_signatures(ref.anchors).numpy())
        np.testing.assert_array_equal(got.distances, ref.distances.numpy())
        np.testing.assert_array_equal(got.order, ref.order.numpy())
        np.testing.assert_array_equal(got.representatives, ref.representatives.numpy())
        np.testing.assert_array_equal(got.keep, ref.keep.numpy())


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
def test_block_wise_kvcrush_keeps_the_references_blocks(gpu, sub_group):
    """Block-wise: the blocks' summed scores, then the same selection over blocks."""
    rng = np.random.default_rng(3)
    block, n = 32, 32 * 40 + 5
    scores = scores_with_ties(rng, 9, n)
    plan = plan_spans(torch.from_numpy(scores)[None], 512, 32, 64, block, reserved=4, what="test")
    sums = gpu.submit(kvcrush.block_sums, scores[:, : plan.full * block], block, sub_group).result()
    np.testing.assert_array_equal(sums, plan.scores[0].numpy())
    want = reference.kvcrush_select_blocks(torch.from_numpy(scores)[None], block, 512, 32, 64, 4 * block)[0]
    ref = reference.kvcrush_select(plan.scores, plan.budget, plan.sink, plan.recent, 4)[0]
    got = gpu.submit(
        kvcrush.kvcrush_select,
        sums,
        plan.budget,
        plan.sink,
        plan.recent,
        4,
        anchor_bits=ref.anchors.numpy(),
        sub_group=sub_group,
    ).result()
    np.testing.assert_array_equal(plan.tokens(torch.from_numpy(got.keep).long()).numpy(), want.numpy())


def test_a_sub_group_size_the_device_lacks_is_refused_by_name(gpu):
    with pytest.raises(runtime.GPUPathError, match=r"sub_group=4 is not supported .* allowed"):
        gpu.submit(attention.paged_decode, layout.PoolShape("f32", 32, 64), *empty_heads(), 4).result()


def empty_heads():
    return (
        np.zeros(layout.PoolShape("f32", 32, 64).block_bytes, np.uint8),
        np.zeros((1, 1), np.int32),
        np.ones(1, np.int32),
        np.zeros((1, 64), np.float32),
        1.0,
    )
