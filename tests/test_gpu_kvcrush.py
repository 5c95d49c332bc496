"""KVCrush's selection on the GPU path (issue 49) on Intel's OpenCL CPU runtime, at sub-group
sizes 8 and 16: every step's integer output (decisions, signatures, anchors, Hamming distances,
the bucketing order, representatives, the kept tokens) equal to the reference's
(``methods.kvcrush``), on scores full of ties. The kernels run in the ``gpu_worker`` process
(conftest); without Intel's runtime the tests skip, naming what is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_kvcrush.gpu import kvcrush
from ov_kvcrush.methods import kvcrush as reference
from ov_kvcrush.methods.selection import plan_spans

SUB_GROUPS = (8, 16)


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


@pytest.mark.parametrize(("sub_group", "one_launch"), [(8, False), (16, False), (16, True)])
@pytest.mark.parametrize(("signature", "anchors", "multi", "representative"), KVCRUSH_CASES)
def test_kvcrush_steps_equal_the_reference(gpu_worker, signature, anchors, multi, representative, sub_group,
                                           one_launch):  # fmt: skip
    """A kernel a step, or every step in one launch (its steps' results read from its scratch)."""
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
        got = gpu_worker.submit(
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
            one_launch=one_launch,
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
def test_block_wise_kvcrush_keeps_the_references_blocks(gpu_worker, sub_group):
    """Block-wise: the blocks' summed scores, then the same selection over blocks."""
    rng = np.random.default_rng(3)
    block, n = 32, 32 * 40 + 5
    scores = scores_with_ties(rng, 9, n)
    plan = plan_spans(torch.from_numpy(scores)[None], 512, 32, 64, block, reserved=4, what="test")
    sums = gpu_worker.submit(kvcrush.block_sums, scores[:, : plan.full * block], block, sub_group).result()
    np.testing.assert_array_equal(sums, plan.scores[0].numpy())
    want = reference.kvcrush_select_blocks(torch.from_numpy(scores)[None], block, 512, 32, 64, 4 * block)[0]
    ref = reference.kvcrush_select(plan.scores, plan.budget, plan.sink, plan.recent, 4)[0]
    got = gpu_worker.submit(
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


def test_block_wise_kvcrush_in_one_launch_keeps_the_references_tokens(gpu_worker):
    """Block-wise in one launch over the tokens' scores: the blocks' sums, the selection over
    whole blocks, their tokens and the partial block's, listed on the device."""
    rng = np.random.default_rng(5)
    block, n = 16, 16 * 70 + 9
    scores = scores_with_ties(rng, 9, n)
    for mean in (False, True):
        plan = plan_spans(torch.from_numpy(scores)[None], 600, 16, 32, block, reserved=6, what="test")
        anchors = ("random", "mean") if mean else ("random",)
        want = reference.kvcrush_select_blocks(torch.from_numpy(scores)[None], block, 600, 16, 32, 6 * block,
                                               anchors=anchors)[0]  # fmt: skip
        ref = reference.kvcrush_select(plan.scores, plan.budget, plan.sink, plan.recent, 6, anchors=anchors)[0]
        got = gpu_worker.submit(
            kvcrush.kvcrush_select, scores, plan.budget, plan.sink, plan.recent, 6, anchor_bits=ref.anchors.numpy(),
            mean_anchor=tuple(a == "mean" for a in anchors), one_launch=True, block=block,
        ).result()  # fmt: skip
        np.testing.assert_array_equal(got.keep, want.numpy())
        np.testing.assert_array_equal(got.representatives, ref.representatives.numpy())
