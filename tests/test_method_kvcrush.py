"""KVCrush: signatures, Hamming distance, anchors, buckets and representatives against brute force;
and the op's C++ port against this reference, step by step."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import KVCrushConfig
from ov_kvcrush.methods.attention import LogitMap, attend
from ov_kvcrush.methods.kvcrush import (
    KVCrushSelection,
    bucket_order,
    hamming,
    head_decisions,
    kvcrush_select,
    kvcrush_select_blocks,
    make_anchors,
    pack_signatures,
    popcount,
)
from ov_kvcrush.methods.selection import keep_indices
from ov_kvcrush.methods.vectors import layer_vectors


@settings(max_examples=100, deadline=None)
@given(heads=st.integers(1, 100), seed=st.integers(0, 10_000))
def test_popcount_hamming_equals_brute_force(heads, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(5, heads, generator=g) < 0.5
    b = torch.rand(5, heads, generator=g) < 0.5
    got = hamming(pack_signatures(a), pack_signatures(b))
    want = [sum(int(x != y) for x, y in zip(a[i].tolist(), b[i].tolist(), strict=True)) for i in range(5)]
    assert got.tolist() == want


def test_popcount_of_every_byte_and_large_words():
    x = torch.arange(256, dtype=torch.int64)
    assert popcount(x).tolist() == [bin(i).count("1") for i in range(256)]
    big = torch.tensor([2**32 - 1, 2**31, 0x55555555], dtype=torch.int64)
    assert popcount(big).tolist() == [32, 1, 16]


def test_signature_bit_h_is_head_h():
    bits = torch.zeros(1, 40, dtype=torch.bool)
    bits[0, 33] = True
    words = pack_signatures(bits)
    assert words.tolist() == [[0, 2]]


def test_head_decisions_topk_and_threshold():
    scores = torch.tensor([[[0.1, 0.5, 0.5, 0.2, 0.9]]])
    top2 = head_decisions(scores, 2, "topk")[0, 0].tolist()
    assert top2 == [False, True, False, False, True]  # tie 0.5/0.5 goes to the earlier token
    thr = head_decisions(scores, 0, "threshold")[0, 0].tolist()
    assert thr == [False, True, True, False, True]  # mean is 0.44


def test_anchor_modes():
    bits = torch.tensor([[[1, 1, 0, 0], [1, 0, 0, 1], [1, 1, 1, 0]]], dtype=torch.bool)
    a = make_anchors(bits, ("zeros", "ones", "alternating", "mean", "random"), seed=3)
    assert a[0, 0].tolist() == [False] * 4
    assert a[0, 1].tolist() == [True] * 4
    assert a[0, 2].tolist() == [True, False, True, False]
    assert a[0, 3].tolist() == [True, True, False, False]  # per-bit majority
    again = make_anchors(bits, ("zeros", "ones", "alternating", "mean", "random"), seed=3)
    assert torch.equal(a, again)
    other = [make_anchors(bits, ("random",), seed=s)[0, 0].tolist() for s in range(8)]
    assert len({tuple(o) for o in other}) > 1


def test_a_kv_head_reads_its_groups_bits_of_the_layers_anchor():
    modes = ("zeros", "ones", "alternating", "random", "mean")
    layer = make_anchors(torch.zeros(1, 0, 9, dtype=torch.bool), modes, seed=5)
    group_bits = torch.tensor([[[1, 0, 1], [1, 1, 0], [1, 0, 0]]], dtype=torch.bool)
    for offset in (0, 3, 6):
        part = make_anchors(group_bits, modes, seed=5, draw=(9, offset))
        assert torch.equal(part[0, :4], layer[0, :4, offset : offset + 3])  # fixed anchors: the layer's bits
        assert part[0, 4].tolist() == [True, False, False]  # mean: the group's own majority
    with pytest.raises(ValueError, match="outside the 9 drawn"):
        make_anchors(group_bits, modes, seed=5, draw=(9, 7))


def test_head_scope_selects_per_kv_head_from_its_own_query_group():
    """scope="head": KV head g keeps what KVCrush keeps for its query group alone (anchors cut from
    the layer's), so heads whose queries want other tokens keep other tokens; scope="layer" keeps
    one choice in every head."""
    scores, _ = selection(n=300)  # [1, 9, 300]: three KV heads of three query heads each
    favourite = torch.zeros_like(scores)
    for g in range(3):  # each group strongly wants its own run of 40 tokens
        favourite[:, 3 * g : 3 * g + 3, 40 + 80 * g : 80 + 80 * g] = 10.0
    scores = scores + favourite
    cfg = KVCrushConfig(budget=96, sink_tokens=8, recent_tokens=16, representatives=24, scope="head")
    keep = cfg.make_layer(0, 1).select(scores, 3)  # [1, 3, 96]
    for g in range(3):
        want = kvcrush_select(scores[:, 3 * g : 3 * g + 3], 96, 8, 16, 24, anchor_draw=(9, 3 * g))[0].keep
        assert torch.equal(keep[0, g], want)
        assert set(range(40 + 80 * g, 80 + 80 * g)) <= set(keep[0, g].tolist())  # its own favourites
    assert not set(range(40, 80)) <= set(keep[0, 1].tolist())  # not another group's
    layer = KVCrushConfig(budget=96, sink_tokens=8, recent_tokens=16, representatives=24).make_layer(0, 1)
    shared = layer.select(scores, 3)
    assert all(torch.equal(shared[0, 0], shared[0, g]) for g in range(3))
    with pytest.raises(ConfigError, match="scope"):
        KVCrushConfig(budget=96, scope="group")


def test_selection_h2o_scores_the_prompt_by_every_row():
    """selection="h2o": the prompt's tokens are scored by the attention every row gave them (H2O's
    sums), the default by SnapKV's window; the op is told the same."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 200, 64, generator=g) for h in (6, 2, 2))
    every_row = attend(q, k, k, q_positions=torch.arange(200), k_positions=torch.arange(200), return_scores=True)
    for selection, scoring in (("h2o", "h2o"), ("snapkv", "snapkv")):
        cfg = KVCrushConfig(budget=96, sink_tokens=8, recent_tokens=16, selection=selection)
        assert cfg.scoring_mode() == scoring and cfg.op_fields(1, 6, 32)["scoring"] == scoring
        layer = cfg.make_layer(0, 1)
        layer.prefill(q, k, v)
        kept = layer.store.positions[0, 0]
        want = every_row.scores if selection == "h2o" else cfg.prompt_scores(q, k, None, LogitMap(64**-0.5))
        assert torch.allclose(layer.acc[0], want[0][:, kept], atol=1e-5)


def test_bucket_order_single_and_multi_anchor():
    d = torch.tensor([[[2, 0], [1, 3], [2, 1], [1, 0], [0, 2]]])
    assert bucket_order(d[..., :1]).tolist() == [[4, 1, 3, 0, 2]]  # by distance, ties by position
    assert bucket_order(d, "tuple").tolist() == [[4, 3, 1, 0, 2]]  # lexicographic (d0, d1)
    # nearest anchor: tokens 0 (a1, 0), 1 (a0, 1), 2 (a1, 1), 3 (a1, 0), 4 (a0, 0)
    assert bucket_order(d, "nearest").tolist() == [[4, 1, 0, 3, 2]]


def selection(seed=0, n=300, budget=96, reps=24, **kw):
    vec = layer_vectors(seed, tokens=n)
    pos = torch.arange(n)
    scores = attend(vec.queries, vec.keys, vec.values, q_positions=pos, k_positions=pos, return_scores=True).scores
    return scores, kvcrush_select(scores, budget, 8, 16, reps, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"anchors": ("zeros",), "representative": "first"},
        {"anchors": ("mean",), "signature": "threshold"},
        {"anchors": ("zeros", "ones", "alternating"), "multi_anchor": "tuple"},
        {"anchors": ("random", "random"), "multi_anchor": "nearest"},
    ],
)
def test_one_representative_per_contiguous_bucket_disjoint_from_important(kw):
    scores, sels = selection(**kw)
    s = sels[0]
    n = scores.shape[-1]
    assert s.keep.numel() == 96
    assert s.important.numel() == 96 - 24 and s.representatives.numel() == 24
    assert not set(s.important.tolist()) & set(s.representatives.tolist())
    assert sorted(s.important.tolist() + s.representatives.tolist()) == s.keep.tolist()
    assert set(s.evictable.tolist()) == set(range(n)) - set(s.important.tolist())
    # buckets: contiguous ranges that tile the ordering, one representative inside each
    bounds = s.bounds
    assert bounds[0][0] == 0 and bounds[-1][1] == s.evictable.numel()
    assert all(bounds[i][1] == bounds[i + 1][0] and bounds[i][1] > bounds[i][0] for i in range(len(bounds) - 1))
    sizes = [e - b for b, e in bounds]
    assert max(sizes) - min(sizes) <= 1
    ordered = s.evictable[s.order]
    for (b, e), rep in zip(bounds, s.representatives.tolist(), strict=True):
        assert rep in ordered[b:e].tolist()
    # the ordering is sorted by the distance key(s), ties by position
    key = [tuple(s.distances[i].tolist()) for i in s.order.tolist()]
    if kw.get("multi_anchor") == "nearest":
        key = [(min(range(len(k)), key=lambda a, k=k: (k[a], a)), min(k)) for k in key]
    assert key == sorted(key)
    for i in range(len(key) - 1):
        if key[i] == key[i + 1]:
            assert s.order[i] < s.order[i + 1]


def test_distances_match_brute_force_and_representative_is_bucket_max():
    scores, sels = selection(anchors=("zeros",))
    s = sels[0]
    # zeros anchor: distance = number of heads retaining the token (top-k of the middle per head)
    middle = scores[0, :, 8 : 300 - 16]
    per_head = 96 - 8 - 16
    for j, tok in enumerate(s.evictable.tolist()[:50]):
        votes = 0
        for h in range(9):
            order = sorted(range(middle.shape[1]), key=lambda i, h=h: (-middle[h, i].item(), i))[:per_head]
            votes += int((tok - 8) in order)
        assert int(s.distances[j, 0]) == votes
    combined = scores[0].sum(0)
    ordered = s.evictable[s.order]
    for (b, e), rep in zip(s.bounds, s.representatives.tolist(), strict=True):
        members = ordered[b:e].tolist()
        assert combined[rep] == max(combined[m] for m in members)


def test_seeded_determinism_and_seed_sensitivity():
    scores, a = selection(seed=4)
    _, b = selection(seed=4)
    assert torch.equal(a[0].keep, b[0].keep)
    by_seed = {tuple(kvcrush_select(scores, 96, 8, 16, 24, seed=s)[0].keep.tolist()) for s in range(6)}
    assert len(by_seed) > 1  # the random anchor really depends on the seed


def test_budget_larger_than_context_keeps_all_and_zero_representatives_is_importance():
    scores = torch.rand(1, 9, 50)
    s = kvcrush_select(scores, 80, 4, 4, 10)[0]
    assert s.keep.tolist() == list(range(50))
    s0 = kvcrush_select(scores, 30, 4, 4, 0)[0]
    assert s0.keep.tolist() == keep_indices(scores.sum(1, keepdim=True), 30, 4, 4)[0, 0].tolist()
    with pytest.raises(ConfigError, match="representatives"):
        kvcrush_select(scores, 30, 4, 4, 23)


@pytest.mark.parametrize("seed", range(5))
def test_one_bucket_is_importance_at_the_whole_budget(seed):
    """With one bucket, its highest-scoring token is the first one importance left out: KVCrush is
    then SnapKV/H2O at the whole budget, in tokens and in spans. Each further bucket's representative
    is the best of its own range, which a single needle's next-ranked span need not be."""
    scores = torch.rand(1, 9, 203, generator=torch.Generator().manual_seed(seed))
    one = kvcrush_select(scores, 60, 4, 8, 1)[0].keep
    assert one.tolist() == keep_indices(scores.sum(1, keepdim=True), 60, 4, 8)[0, 0].tolist()
    spans = kvcrush_select_blocks(scores, 16, 96, 16, 16, 16)[0]  # one representative span
    assert spans.tolist() == kvcrush_select_blocks(scores, 16, 96, 16, 16, 0)[0].tolist()
    assert kvcrush_select(scores, 60, 4, 8, 12)[0].keep.tolist() != one.tolist()


def test_block_wise_keeps_whole_blocks_and_the_partial_tail():
    scores = torch.rand(1, 9, 203, generator=torch.Generator().manual_seed(0))
    keep = kvcrush_select_blocks(scores, 16, 96, 16, 16, 32)[0]
    tail = list(range(192, 203))
    assert keep[-11:].tolist() == tail
    blocks = keep[:-11].reshape(-1, 16)
    assert all(b.tolist() == list(range(int(b[0]), int(b[0]) + 16)) and int(b[0]) % 16 == 0 for b in blocks)
    assert keep.numel() <= 96
    # the same as token-level KVCrush over per-block summed scores
    block_scores = scores[..., :192].reshape(1, 9, 12, 16).sum(-1)
    want = kvcrush_select(block_scores, (96 - 11) // 16, 1, 1, 2)[0].keep
    assert (blocks[:, 0] // 16).tolist() == want.tolist()


def test_layer_cache_keeps_the_same_tokens_in_every_head():
    vec = layer_vectors(11, tokens=260)
    for block in (None, 16):
        cfg = KVCrushConfig(budget=96, sink_tokens=16, recent_tokens=16, block_size=block, anchor=("zeros", "ones"))
        cache = cfg.make_layer(0, 1)
        cache.prefill(*vec.prefix(200))
        for i in range(200, 260):
            cache.decode(*vec.step(i))
            pos = cache.kept_positions()[0]
            assert all(torch.equal(pos[0], pos[h]) for h in range(3))
            assert pos.shape[-1] <= 96


def test_config_validation():
    with pytest.raises(ConfigError, match="anchor"):
        KVCrushConfig(budget=256, anchor="diagonal")
    with pytest.raises(ConfigError, match="representatives"):
        KVCrushConfig(budget=256, representatives=500)
    with pytest.raises(ConfigError, match="head_budgets"):
        KVCrushConfig(budget=256, head_budgets="adaptive")
    assert KVCrushConfig(budget=256).n_representatives == (256 - 80) // 4
    assert KVCrushConfig(budget=256, anchor=("zeros", "mean")).anchors == ("zeros", "mean")


# --------------------------------------------------------------------------------------------
# the op's port, step by step: each step's result in the C++ op against the reference's

#: (fields, query heads, tokens, integer scores with ties); budget 96, sinks 8, recent 16, 24 representatives
STEP_CASES = {
    "topk": (dict(), 9, 300, False),
    "threshold": (dict(signature="threshold"), 9, 300, False),
    "first": (dict(representative="first"), 9, 300, False),
    "random+mean": (dict(anchor=("random", "mean")), 9, 300, False),
    "nearest of three": (dict(anchor=("ones", "zeros", "alternating"), multi_anchor="nearest"), 9, 300, False),
    "ties": (dict(anchor="mean", seed=7), 9, 300, True),
    "decode step": (dict(), 9, 97, False),  # one token over budget: each head drops one (the fast path)
    "two words": (dict(anchor=("random", "ones")), 70, 300, False),  # 70 heads: signatures of two words
}
STEP_BUDGET, STEP_SINKS, STEP_RECENT, STEP_REPS = 96, 8, 16, 24


@cache
def op_and_reference_steps(case: str) -> tuple[dict[str, np.ndarray], KVCrushSelection]:
    from ov_kvcrush.methods import method_config
    from ov_kvcrush.op import plugin
    from ov_kvcrush.op.method_spec import method_spec

    fields, h, n, ties = STEP_CASES[case]
    rng = np.random.default_rng(11)
    scores = (rng.integers(0, 4, (h, n)) if ties else rng.random((h, n))).astype(np.float32)
    cfg = method_config(
        "kvcrush",
        budget=STEP_BUDGET,
        sink_tokens=STEP_SINKS,
        recent_tokens=STEP_RECENT,
        representatives=STEP_REPS,
        **fields,
    )
    bits, anchors = np.zeros((n, h), np.uint8), np.zeros((16, h), np.uint8)
    evictable, order, reps, keep = (np.zeros(n, np.int64) for _ in range(4))
    distances, counts = np.zeros(n * 16, np.int64), np.zeros(4, np.int64)
    ptr = [np.ctypeslib.as_ctypes(a.reshape(-1)) for a in (bits, anchors, evictable, distances, order, reps, keep)]
    plugin.check_result(
        plugin.load().ovkc_kvcrush_trace(
            np.ctypeslib.as_ctypes(scores.reshape(-1)),
            h,
            n,
            STEP_BUDGET,
            STEP_SINKS,
            STEP_RECENT,
            STEP_REPS,
            method_spec(cfg, 1, h, 32).encode(),
            *ptr,
            np.ctypeslib.as_ctypes(counts),
        )
    )
    m, a, r, k = (int(c) for c in counts)
    op = {
        "bits": bits.astype(bool),
        "anchors": anchors[:a].astype(bool),
        "evictable": evictable[:m],
        "distances": distances[: m * a].reshape(m, a),
        "order": order[:m],
        "representatives": reps[:r],
        "keep": keep[:k],
    }
    ref = kvcrush_select(
        torch.from_numpy(scores)[None],
        STEP_BUDGET,
        STEP_SINKS,
        STEP_RECENT,
        STEP_REPS,
        signature=cfg.signature,
        anchors=cfg.anchors,
        multi_anchor=cfg.multi_anchor,
        seed=cfg.seed,
        representative=cfg.representative,
    )[0]
    return op, ref


@pytest.mark.parametrize("case", STEP_CASES)
def test_op_signatures_are_the_references(case):
    """head_decisions then pack_signatures: every token's bits (sinks and recent all 0)."""
    op, ref = op_and_reference_steps(case)
    np.testing.assert_array_equal(op["bits"], ref.bits.numpy())


@pytest.mark.parametrize("case", STEP_CASES)
def test_op_important_tokens_leave_the_references_evictable(case):
    op, ref = op_and_reference_steps(case)
    np.testing.assert_array_equal(op["evictable"], ref.evictable.numpy())


@pytest.mark.parametrize("case", STEP_CASES)
def test_op_anchors_are_the_references(case):
    """make_anchors: drawn anchors as the spec carries them, a mean anchor from the evictable tokens."""
    op, ref = op_and_reference_steps(case)
    np.testing.assert_array_equal(op["anchors"], ref.anchors.numpy())


@pytest.mark.parametrize("case", STEP_CASES)
def test_op_distances_are_the_references(case):
    op, ref = op_and_reference_steps(case)
    np.testing.assert_array_equal(op["distances"], ref.distances.numpy())


@pytest.mark.parametrize("case", STEP_CASES)
def test_op_bucket_order_is_the_references(case):
    op, ref = op_and_reference_steps(case)
    np.testing.assert_array_equal(op["order"], ref.order.numpy())


@pytest.mark.parametrize("case", STEP_CASES)
def test_op_representatives_are_the_references(case):
    """bucket_bounds then one representative per bucket, in bucket order; and the kept tokens."""
    op, ref = op_and_reference_steps(case)
    assert len(op["representatives"]) == len(ref.bounds) == min(STEP_REPS, len(ref.evictable))
    np.testing.assert_array_equal(op["representatives"], ref.representatives.numpy())
    np.testing.assert_array_equal(op["keep"], ref.keep.numpy())
