"""KVCrush's selection on the GPU path (issue 49) on Intel's OpenCL CPU runtime, in one launch:
every step's integer output (decisions, signatures, anchors, Hamming distances, the bucketing
order, representatives, the kept tokens) equal to the reference's (``methods.kvcrush``), on
scores full of ties. The kernels run in the ``gpu_worker`` process
(conftest); without Intel's runtime the tests skip, naming what is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_kvcrush.gpu import kvcrush
from ov_kvcrush.methods import kvcrush as reference
from ov_kvcrush.methods.selection import plan_spans


def scores_with_ties(rng: np.random.Generator, h: int, n: int) -> np.ndarray:
    """Scores of few distinct values (exact in any summation order): ties everywhere, which the
    reference breaks toward the earlier token."""
    return rng.integers(0, 6, size=(h, n)).astype(np.float32)


KVCRUSH_CASES = [
    ("topk", ("random",), "tuple", "max_score"),
    ("topk", ("random", "mean"), "tuple", "first"),
    ("threshold", ("random", "zeros", "mean"), "nearest", "max_score"),
    ("threshold", ("alternating",), "tuple", "first"),
    # eight anchors over 40 heads: a tuple key of 41^8 fits no integer, so the order is sorted an
    # anchor's distance at a time, as the reference's
    ("topk", ("random",) * 7 + ("mean",), "tuple", "first"),
]


@pytest.mark.parametrize(("signature", "anchors", "multi", "representative"), KVCRUSH_CASES)
def test_kvcrush_steps_equal_the_reference(gpu_worker, signature, anchors, multi, representative):
    """Every step in one launch, its steps' results read from its scratch."""
    rng = np.random.default_rng(len(anchors) * 10 + 16)
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
        ).result()
        np.testing.assert_array_equal(got.evictable, ref.evictable.numpy())
        np.testing.assert_array_equal(got.important, np.sort(ref.important.numpy()))
        np.testing.assert_array_equal(got.signatures, reference.pack_signatures(ref.bits).numpy())
        np.testing.assert_array_equal(got.anchors, reference.pack_signatures(ref.anchors).numpy())
        np.testing.assert_array_equal(got.distances, ref.distances.numpy())
        np.testing.assert_array_equal(got.order, ref.order.numpy())
        np.testing.assert_array_equal(got.representatives, ref.representatives.numpy())
        np.testing.assert_array_equal(got.keep, ref.keep.numpy())


@pytest.mark.parametrize(("signature", "anchors", "multi", "representative"), KVCRUSH_CASES[:3])
def test_a_selection_of_thousands_of_units_in_one_launch_equals_the_reference(gpu_worker, signature, anchors, multi,
                                                                              representative):  # fmt: skip
    """Past the 2,048 units a work-group once ranked quadratically (a long prompt token by token):
    the one launch's sorts (top-k ranks, the stable orders, the kept units listed) give every
    step's result of the reference, ties included; not a power of two of units, so the sorts pad."""
    rng = np.random.default_rng(29)
    h, n, budget, sinks, recent, reps = 9, 4100, 1500, 4, 64, 300
    scores = scores_with_ties(rng, h, n)
    ref = reference.kvcrush_select(torch.from_numpy(scores)[None], budget, sinks, recent, reps, signature=signature,
                                   anchors=anchors, multi_anchor=multi, representative=representative)[0]  # fmt: skip
    got = gpu_worker.submit(
        kvcrush.kvcrush_select, scores, budget, sinks, recent, reps, anchor_bits=ref.anchors.numpy(),
        mean_anchor=tuple(a == "mean" for a in anchors), signature=signature, multi_anchor=multi,
        representative=representative,
    ).result()  # fmt: skip
    np.testing.assert_array_equal(got.important, np.sort(ref.important.numpy()))
    np.testing.assert_array_equal(got.signatures, reference.pack_signatures(ref.bits).numpy())
    np.testing.assert_array_equal(got.order, ref.order.numpy())
    np.testing.assert_array_equal(got.representatives, ref.representatives.numpy())
    np.testing.assert_array_equal(got.keep, ref.keep.numpy())


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
            mean_anchor=tuple(a == "mean" for a in anchors), block=block,
        ).result()  # fmt: skip
        np.testing.assert_array_equal(got.keep, want.numpy())
        np.testing.assert_array_equal(got.representatives, ref.representatives.numpy())


def _step_drops(sequences: list[tuple[np.ndarray, int, int, list]], kv: int) -> np.ndarray:
    """The step's selections of ``sequences`` (each: scores ``[Hq, n]``, its block, its units and
    each row's :class:`~ov_kvcrush.gpu.kvcrush.KVCrushChoice`; or None: no selection) in one
    launch over an arena holding their scores apart: ``dropped[s][kv]``."""
    from ov_kvcrush.gpu.device import DirectTransfers, device

    dev = device(16)
    arena, selections, at = [np.zeros(5, np.float32)], [], 5  # the scores start past word 0
    for item in sequences:
        if item is None:
            selections.append(None)
            continue
        scores, block, units, choices = item
        stride = scores.shape[1] + 3  # rows apart by more than their slots
        rows = np.zeros((scores.shape[0], stride), np.float32)
        rows[:, : scores.shape[1]] = scores
        selection = kvcrush.StepSelection.of(scores.shape[1], block, units, choices)
        assert selection is not None, "one unit dropped in one launch"
        selections.append((selection, at, stride))
        arena.append(rows.ravel())
        at += rows.size
    dropped = dev.empty(4 * len(sequences) * kv)
    kvcrush.launch_step_selections(dev, DirectTransfers(dev), dev.to_device(np.concatenate(arena)), selections, kv,
                                   dropped)  # fmt: skip
    return dev.to_host(dropped, np.int32, (len(sequences), kv))


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_a_steps_selections_in_one_launch_drop_the_unit_the_reference_does_not_keep(gpu_worker, scope):
    """A decode step's selections anew of several sequences, each a token past the budget (token
    by token) or a block's worth (block-wise), in one launch (``step_kvcrush_drop``): each
    sequence's KV heads drop the first slot of the one unit the reference's selection does not
    keep (scope ``layer``: every KV head the layer's; ``head``: each its query group's); a
    sequence without a selection is left alone."""
    rng = np.random.default_rng(17)
    q_heads, kv, sinks, recent, reps, block = 8, 2, 4, 8, 32, 16
    anchors = ("random", "mean")
    heads = [slice(0, q_heads)] if scope == "layer" else [slice(g * 4, g * 4 + 4) for g in range(kv)]
    sequences, wants = [], []
    # (slots held, unit, budget): the last past the 2,048 units a work-group once ranked quadratically
    cases = ((97, 1, 96), (97, 1, 96), None, (105, block, 96), (112, block, 96), (2_100, 1, 2_099))
    for case in cases:
        if case is None:
            sequences.append(None)
            wants.append(None)
            continue
        n, unit, budget = case
        scores = scores_with_ties(rng, q_heads, n)
        if unit == 1:
            counts, units = (budget, sinks, recent, reps), n
        else:
            plan = plan_spans(torch.zeros(1, 1, n), budget, sinks, recent, block, reserved=reps // block, what="test")
            counts, units = (plan.budget, plan.sink, plan.recent, reps // block), plan.full
        choices, dropped = [], []
        for rows in heads:
            t = torch.from_numpy(scores[rows])[None]
            if unit == 1:
                ref = reference.kvcrush_select(t, budget, sinks, recent, reps, anchors=anchors)[0]
                keep = ref.keep.numpy()
            else:
                ref = reference.kvcrush_select(reference_blocks(t, block, units), *counts, anchors=anchors)[0]
                kept = reference.kvcrush_select_blocks(t, block, budget, sinks, recent, reps, anchors=anchors)
                keep = kept[0].numpy()
            gone = np.setdiff1d(np.arange(n), keep)
            assert len(gone) == unit and (np.diff(gone) == 1).all(), gone  # one unit
            dropped.append(int(gone[0]))
            bits = ref.anchors.numpy().copy()
            bits[1] = False  # the mean anchor: computed on the device
            choices.append(kvcrush.KVCrushChoice(*counts, bits, (False, True)))
        sequences.append((scores, unit, units, choices))
        wants.append(dropped * kv if scope == "layer" else dropped)
    got = gpu_worker.submit(_step_drops, sequences, kv).result()
    for s, want in enumerate(wants):
        if want is not None:
            assert got[s].tolist() == want, (s, got[s], want)


def reference_blocks(scores: torch.Tensor, block: int, units: int) -> torch.Tensor:
    """The whole blocks' summed scores ``[1, H, units]`` (the block-wise form's units)."""
    return scores[..., : units * block].reshape(*scores.shape[:2], units, block).sum(-1)
