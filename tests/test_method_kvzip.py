"""KVzip: the reference against brute force, and the op against the reference.

The reference's pieces are checked alone (the global selection by sorting every score, the
largest attention by the full probability matrix), then a scoring pass on the shared vectors:
the pass keeps nothing of its steps, scores only its chunk, and the selection keeps the budget
summed over layers, unevenly. The op runs the same pass on two one-op layers of one sequence and
must keep exactly the reference's tokens per layer and head, then decode to the same outputs.
Over the 2-/4-bit store both quantize the same tokens after a pass and keep them through a second
turn's pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import HKV, HQ, D, held_positions, op_model, reference_positions

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import KVzipConfig, QuantSettings, method_config
from ov_kvcrush.methods.kvzip import max_attention, select_kept
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache
from ov_kvcrush.op.method_spec import method_spec


def test_config_fields_are_validated_by_name():
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVzipConfig(budget=64, chunk_tokens=8)
    with pytest.raises(ConfigError, match="allocation"):
        KVzipConfig(budget=64, allocation="head")
    with pytest.raises(ConfigError, match=r"quant\.prompt_tail"):  # the question comes after the pass
        KVzipConfig(budget=64, quant=QuantSettings(prompt_tail=16))
    assert KVzipConfig(budget=64, quant=QuantSettings(bits=4)).quant.pinned_tail(selecting=False) == 0
    with pytest.raises(ConfigError, match="slack_tokens"):
        KVzipConfig(budget=64, slack_tokens=-1)
    with pytest.raises(ConfigError, match="budget"):
        KVzipConfig(budget=2, sink_tokens=4)
    # a pass is due past the budget plus the slack, per layer and KV head
    cfg = KVzipConfig(budget=64, slack_tokens=16)
    assert not cfg.scoring_pass_due(80 * 2 * 3, 2, 3) and cfg.scoring_pass_due(80 * 2 * 3 + 1, 2, 3)
    assert method_config("kvzip", budget=64).scoring_pass


@pytest.mark.parametrize("n", [1, 300, 512, 700, 800, 3089])
@pytest.mark.parametrize("multiple", [1, 128])
def test_scoring_pass_steps_cover_the_context_in_chunks(n, multiple):
    cfg = KVzipConfig(budget=64, chunk_tokens=512, overlap_tokens=8, step_multiple=multiple)
    context = list(range(1000, 1000 + n))
    encode = lambda text: [len(text)]  # noqa: E731  (one id per prompt, enough to find it)
    steps = cfg.scoring_pass_inputs(context, encode, [7, 7])
    assert cfg.scoring_pass_inputs([], encode, []) == []
    assert [s.lo for s in steps] == [0, *[s.hi for s in steps[:-1]]] and steps[-1].hi == n
    sizes = [s.hi - s.lo for s in steps]
    if multiple == 1:  # equal chunks
        assert len(steps) == max(1, round(n / 512))
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 1.5 * 512
    else:  # every step but the last feeds 512 ids (a chunk of 512 less its request), the last the rest
        assert all(len(s.ids) == 512 for s in steps[:-1]) and len(steps[-1].ids) <= 512
        assert len(steps) == 1 + sum(n > 512 - 3 + k * (512 - 11) for k in range(8))
    assert max(len(s.ids) for s in steps) <= cfg.scoring_step_bound(encode, [7, 7])
    for i, s in enumerate(steps):
        chunk = context[s.lo : s.hi]
        assert s.ids[-len(chunk) - 2 :] == [7, 7, *chunk]  # the generation prefix, then the chunk
        if i:  # a later chunk's request ends with the previous chunk's last tokens
            assert s.ids[: -len(chunk) - 2][-8:] == context[s.lo - 8 : s.lo]


@pytest.mark.parametrize("allocation", ["global", "layer"])
def test_select_kept_is_the_top_of_a_sort(allocation):
    g = torch.Generator().manual_seed(3)
    scores = [torch.rand(1, 3, n, generator=g).round(decimals=2) for n in (40, 55, 30)]  # ties on purpose
    scores[1][0, 2, 50:] = float("-inf")  # padding
    scores[0][0, 0, :4] = float("inf")  # protected
    budget = 12
    kept = select_kept(scores, budget, allocation)
    groups = [[0], [1], [2]] if allocation == "layer" else [[0, 1, 2]]
    for group in groups:
        entries = [
            (-float(scores[i][0, h, j]), i, h, j)
            for i in group
            for h in range(3)
            for j in range(scores[i].shape[2])
            if scores[i][0, h, j] > float("-inf")
        ]
        total = budget * 3 * len(group)
        want = {e[1:] for e in sorted(entries)[:total]}
        got = {(i, h, j) for i in group for h, j in zip(*np.nonzero(kept[i][0].numpy()), strict=True)}
        assert got == want


def test_max_attention_is_the_largest_probability_of_the_group():
    v = layer_vectors(4, tokens=50)
    q, k = v.queries[:, :, 40:], v.keys
    pos = torch.arange(50)
    mask = torch.ones(1, HKV, 50, dtype=torch.bool)
    mask[0, 1, 10:20] = False
    got = max_attention(q, k, pos[40:], pos.expand(1, HKV, 50), mask, None)
    logits = torch.einsum("bhtd,bhnd->bhtn", q, k.repeat_interleave(HQ // HKV, 1)) / D**0.5
    allowed = (pos[None, :] <= pos[40:, None])[None, None] & mask.repeat_interleave(HQ // HKV, 1)[:, :, None]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    want = probs.amax(2).view(1, HKV, HQ // HKV, 50).amax(2)
    torch.testing.assert_close(got, want)


def _reference_pass(cfg, v, layers, prompt, steps):
    """Prefill ``prompt`` tokens into ``layers`` reference caches (the same vectors each), run
    the scoring ``steps`` ((start, count, lo, hi) of the vectors), then select."""
    caches = [cfg.make_layer(i, layers) for i in range(layers)]
    q, k, val = v.queries[:, :, :prompt], v.keys[:, :, :prompt], v.values[:, :, :prompt]
    outs = [lc.prefill(q * (1 + 0.1 * i), k, val) for i, lc in enumerate(caches)]
    for start, count, lo, hi in steps:
        s = slice(start, start + count)
        for i, lc in enumerate(caches):
            lc.score_step(v.queries[:, :, s] * (1 + 0.1 * i), v.keys[:, :, s], v.values[:, :, s], (lo, hi))
    return caches, outs


def test_scoring_pass_keeps_nothing_of_its_steps_and_scores_only_its_chunk():
    cfg = KVzipConfig(budget=40)
    v = layer_vectors(5, tokens=260)
    (lc,), _ = _reference_pass(cfg, v, 1, 200, [(200, 30, 50, 120)])
    assert lc.seen == 200 and int(lc.tokens_held().max()) == 200
    scored = lc.score[0] > 0
    assert scored[:, 50:120].all() and not scored[:, :50].any() and not scored[:, 120:].any()


@pytest.mark.parametrize("allocation", ["global", "layer"])
def test_selection_keeps_the_budget_over_layers_unevenly(allocation):
    cfg = KVzipConfig(budget=40, sink_tokens=4, recent_tokens=8, allocation=allocation)
    v = layer_vectors(6, tokens=300)
    caches, _ = _reference_pass(cfg, v, 3, 200, [(200, 50, 0, 100), (250, 50, 100, 200)])
    cfg.finish_scoring_pass(caches)
    held = torch.stack([lc.tokens_held()[0] for lc in caches])  # [layers, heads]
    assert int(held.sum()) == 40 * HKV * 3
    if allocation == "layer":
        assert (held.sum(1) == 40 * HKV).all()
    assert held.min() < held.max()  # heads keep different counts
    for lc in caches:
        for p in reference_positions(lc):
            assert set(range(4)) <= set(p.tolist()) and set(range(192, 200)) <= set(p.tolist())
    # decode after the selection: appended, nothing evicted
    lc = caches[0]
    before = lc.tokens_held().clone()
    lc.decode(v.queries[:, :, 200:201], v.keys[:, :, 200:201], v.values[:, :, 200:201])
    assert (lc.tokens_held() == before + 1).all()


@pytest.mark.parametrize("allocation", ["global", "layer"])
def test_op_keeps_the_reference_tokens_after_a_scoring_pass(ov_core, allocation):
    """Two one-op layers of one sequence against two reference layers: the same pass, the same
    tokens kept per layer and head, then the same decode outputs."""
    layers, prompt = 2, 192
    cfg = KVzipConfig(budget=48, sink_tokens=4, recent_tokens=8, allocation=allocation)
    v = layer_vectors(7, kv_heads=HKV, q_heads=HQ, tokens=prompt + 70, head_dim=D)
    steps = [(prompt, 34, 0, 96), (prompt + 34, 30, 96, prompt)]
    caches, ref_out = _reference_pass(cfg, v, layers, prompt, steps)
    cfg.finish_scoring_pass(caches)

    pool = kvcache.KVPool(layers, HQ, HKV, D, precision="f32", method=method_spec(cfg, layers, HQ, 32))
    seq = pool.new_sequence()
    reqs = [op_model(ov_core, HQ, HKV, D, layer=i) for i in range(layers)]

    def feed(i, s):
        q = (v.queries[:, :, s] * (1 + 0.1 * i)).numpy()
        return reqs[i].infer({"q": q, "k": v.keys[:, :, s].numpy(), "v": v.values[:, :, s].numpy(),
                              "kvc_sequence": np.array([seq.handle])})[0]  # fmt: skip

    for i in range(layers):
        np.testing.assert_allclose(feed(i, slice(0, prompt)), ref_out[i].numpy(), atol=3e-5)
    for start, count, lo, hi in steps:
        seq.score_positions(lo, hi)
        for i in range(layers):
            feed(i, slice(start, start + count))
    assert seq.head_tokens().sum() == layers * HKV * prompt  # the steps were dropped
    seq.end_scoring_pass()
    for i, lc in enumerate(caches):
        got, want = held_positions(seq, i), reference_positions(lc)
        for g in range(HKV):
            np.testing.assert_array_equal(got[g], want[g], err_msg=f"layer {i} head {g}")
    assert int(seq.head_tokens().sum()) == 48 * HKV * layers
    for t in range(prompt, prompt + 3):  # decode over the kept tokens
        for i, lc in enumerate(caches):
            s = slice(t, t + 1)
            ref = lc.decode(v.queries[:, :, s] * (1 + 0.1 * i), v.keys[:, :, s], v.values[:, :, s])
            np.testing.assert_allclose(feed(i, s), ref.numpy(), atol=3e-5)
    st = seq.stats()
    assert st.kv_bytes == pool.stats().kv_bytes


def test_op_refuses_a_scoring_pass_where_there_is_none(ov_core):
    from ov_kvcrush.op.plugin import PluginError

    pool = kvcache.KVPool(1, HQ, HKV, D, method=method_spec(method_config("snapkv", budget=128), 1, HQ, 32))
    seq = pool.new_sequence()
    with pytest.raises(PluginError, match="no scoring pass"):
        seq.score_positions(0, 10)
    kz = kvcache.KVPool(1, HQ, HKV, D, method=method_spec(KVzipConfig(budget=64), 1, HQ, 32))
    empty = kz.new_sequence()
    with pytest.raises(PluginError, match="prefilled prompt"):
        empty.score_positions(0, 10)
    with pytest.raises(PluginError, match="no scoring pass is running"):
        empty.end_scoring_pass()


def _op_head(seq, layer, g):
    pos, keys, _, _ = seq.read_head(layer, g)
    order = np.argsort(pos)
    return pos[order], keys[order]


def _ref_head(lc, g):
    keys, _, pos = lc.store.dense()
    real = pos[0, g] >= 0
    p, k = pos[0, g][real].numpy(), keys[0, g][real].numpy()
    order = np.argsort(p)
    return p[order], k[order]


@pytest.mark.parametrize("bits", [2, 4])
def test_op_and_reference_quantize_the_same_kept_tokens_over_two_turns(ov_core, bits):
    """KVzip over the 2-/4-bit store, two chat turns: after each pass both keep the same tokens
    and quantize the same ones (keys compared by position: a token quantized on one side only
    would differ by its quantization error), the first turn's quantized tokens survive the second
    pass and count against its budget, and decode steps agree."""
    layers, prompt, budget, r = 2, 192, 48, 32
    cfg = KVzipConfig(budget=budget, sink_tokens=4, quant=QuantSettings(bits=bits, residual_tokens=r))
    v = layer_vectors(11, kv_heads=HKV, q_heads=HQ, tokens=341, head_dim=D)
    caches = [cfg.make_layer(i, layers) for i in range(layers)]
    pool = kvcache.KVPool(layers, HQ, HKV, D, precision="f32", method=method_spec(cfg, layers, HQ, 32))
    seq = pool.new_sequence()
    reqs = [op_model(ov_core, HQ, HKV, D, layer=i) for i in range(layers)]

    def step(a, b, kind, scored=None):
        """Vectors [a, b) through both, as a prefill, a decode (or chat turn) or a scoring step."""
        for i, lc in enumerate(caches):
            q, k, val = v.queries[:, :, a:b] * (1 + 0.1 * i), v.keys[:, :, a:b], v.values[:, :, a:b]
            got = reqs[i].infer({"q": q.numpy(), "k": k.numpy(), "v": val.numpy(),
                                 "kvc_sequence": np.array([seq.handle])})[0]  # fmt: skip
            if kind == "prefill":
                want = lc.prefill(q, k, val)
            elif kind == "decode":
                want = lc.decode(q, k, val)
            else:
                want = lc.score_step(q, k, val, scored)
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4, err_msg=f"{kind} [{a}, {b}) layer {i}")

    def scoring_pass(passes):
        for a, b, lo, hi in passes:
            seq.score_positions(lo, hi)
            step(a, b, "score", (lo, hi))
        seq.end_scoring_pass()
        cfg.finish_scoring_pass(caches)

    def same_heads():
        quantized = 0
        for i, lc in enumerate(caches):
            for g in range(HKV):
                (po, ko), (pr, kr) = _op_head(seq, i, g), _ref_head(lc, g)
                np.testing.assert_array_equal(po, pr, err_msg=f"layer {i} head {g}")
                np.testing.assert_allclose(ko, kr, atol=1e-5, err_msg=f"layer {i} head {g}")
            quantized += int((lc.store.qpos >= 0).sum()) if lc.store.qpos is not None else 0
        return quantized

    step(0, prompt, "prefill")
    assert caches[0].store.quantized_tokens == 0  # held whole until the pass
    scoring_pass([(prompt, prompt + 34, 0, 96), (prompt + 34, prompt + 64, 96, prompt)])
    first = same_heads()
    held = sum(int(lc.tokens_held().sum()) for lc in caches)
    assert held == budget * HKV * layers and int(seq.head_tokens().sum()) == held
    assert 0 < first < held  # quantized in whole runs of r per head, the rest full precision
    for lc in caches:
        q = (lc.store.qpos[0] >= 0).sum(-1)
        assert (q % r == 0).all() and (q == lc.tokens_held()[0] // r * r).all()
    frozen = [lc.store.qpos[0].clone() for lc in caches]

    step(256, 258, "decode")  # the answer's first tokens, one step
    step(258, 298, "decode")  # the next turn: 40 tokens at once
    step(298, 299, "decode")
    new = caches[0].seen
    scoring_pass([(299, 339, prompt, new)])
    second = same_heads()
    for lc, before in zip(caches, frozen, strict=True):  # the first turn's quantized tokens stay
        torch.testing.assert_close(lc.store.qpos[0][:, : before.shape[1]], before)
    assert second >= first
    assert sum(int(lc.tokens_held().sum()) for lc in caches) == budget * HKV * layers
    for t in range(339, 341):
        step(t, t + 1, "decode")
