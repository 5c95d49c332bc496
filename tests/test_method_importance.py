"""StreamingLLM / H2O / SnapKV / PyramidKV / per-head budgets against brute-force oracles."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import H2OConfig, PyramidKVConfig, SnapKVConfig, StreamingLLMConfig
from ov_kvcrush.methods.attention import attend
from ov_kvcrush.methods.kvcrush import KVCrushConfig
from ov_kvcrush.methods.selection import (
    adaptive_head_budgets,
    keep_block_indices,
    keep_chunk_indices,
    keep_indices,
    keep_indices_ragged,
    pool_scores,
    pyramid_budgets,
    snapkv_scores,
    span_budget_floor,
)
from ov_kvcrush.methods.vectors import layer_vectors


def brute_keep(scores: list[float], budget: int, sinks: int, recent: int) -> list[int]:
    n = len(scores)
    if budget >= n:
        return list(range(n))
    middle = list(range(sinks, n - recent))
    top = sorted(middle, key=lambda i: (-scores[i], i))[: budget - sinks - recent]
    return sorted(list(range(sinks)) + top + list(range(n - recent, n)))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40),
    budget=st.integers(0, 50),
    sinks=st.integers(0, 5),
    recent=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_keep_indices_matches_brute_force(n, budget, sinks, recent, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (2, 3, n), generator=g).float()  # many ties
    if budget < n and sinks + recent > budget:
        with pytest.raises(ConfigError, match="budget"):
            keep_indices(scores, budget, sinks, recent)
        return
    got = keep_indices(scores, budget, sinks, recent)
    assert got.shape == (2, 3, min(budget, n))
    for b in range(2):
        for h in range(3):
            assert got[b, h].tolist() == brute_keep(scores[b, h].tolist(), budget, sinks, recent)


def test_ragged_selection_with_equal_budgets_is_keep_indices():
    scores = torch.rand(2, 3, 50)
    want = keep_indices(scores, 20, 4, 6)
    got = keep_indices_ragged(scores, torch.full((2, 3), 50), torch.full((2, 3), 20), 4, 6)
    assert torch.equal(got, want)


def test_attention_matches_explicit_softmax_and_returns_cumulative_scores():
    vec = layer_vectors(5, tokens=40, head_dim=16)
    q, k, v = vec.queries, vec.keys, vec.values
    pos = torch.arange(40)
    res = attend(q, k, v, q_positions=pos, k_positions=pos, return_scores=True)
    g = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        logits = q[0, h] @ k[0, h // g].T / math.sqrt(16)
        logits = logits.masked_fill(torch.triu(torch.ones(40, 40, dtype=torch.bool), 1), float("-inf"))
        p = torch.softmax(logits, -1)
        torch.testing.assert_close(res.output[0, h], p @ v[0, h // g], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res.scores[0, h], p.sum(0), rtol=1e-5, atol=1e-5)


def test_snapkv_scores_are_pooled_window_attention():
    vec = layer_vectors(6, tokens=60, head_dim=16)
    q, k = vec.queries, vec.keys
    got = snapkv_scores(q, k, window=8, pool_kernel=5, pool="max")
    g = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        logits = q[0, h, -8:] @ k[0, h // g].T / 4.0
        qpos = torch.arange(52, 60).unsqueeze(1)
        logits = logits.masked_fill(torch.arange(60).unsqueeze(0) > qpos, float("-inf"))
        raw = torch.softmax(logits, -1).sum(0)
        pooled = torch.stack([raw[max(0, i - 2) : i + 3].max() for i in range(60)])
        torch.testing.assert_close(got[0, h], pooled, rtol=1e-5, atol=1e-6)


def test_h2o_keeps_heavy_hitters_of_accumulated_attention():
    vec = layer_vectors(7, tokens=120, head_dim=16)
    cfg = H2OConfig(budget=40, sink_tokens=4, recent_tokens=8)
    cache = cfg.make_layer(0, 1)
    cache.prefill(*vec.prefix(120))
    pos = torch.arange(120)
    scores = attend(vec.queries, vec.keys, vec.values, q_positions=pos, k_positions=pos, return_scores=True).scores
    per_kv = scores.reshape(1, 3, 3, 120).sum(2)
    for h in range(3):
        want = brute_keep(per_kv[0, h].tolist(), 40, 4, 8)
        assert cache.kept_positions()[0, h].tolist() == want


def test_decode_eviction_keeps_budget_sinks_and_recent_every_step():
    vec = layer_vectors(8, tokens=200, head_dim=16)
    for cfg in (
        H2OConfig(budget=48, sink_tokens=4, recent_tokens=8),
        SnapKVConfig(budget=48, sink_tokens=4, recent_tokens=8),
    ):
        cache = cfg.make_layer(0, 1)
        cache.prefill(*vec.prefix(100))
        for i in range(100, 200):
            cache.decode(*vec.step(i))
            pos = cache.kept_positions()
            assert pos.shape[-1] == 48
            for h in range(3):
                kept = set(pos[0, h].tolist())
                assert set(range(4)) <= kept
                assert set(range(i - 7, i + 1)) <= kept
        assert cache.counters["evicted"] == 3 * (200 - 48)


def test_streamingllm_keeps_sinks_and_the_window():
    vec = layer_vectors(9, tokens=100, head_dim=16)
    cache = StreamingLLMConfig(budget=20, sink_tokens=4).make_layer(0, 1)
    cache.prefill(*vec.prefix(60))
    for i in range(60, 100):
        cache.decode(*vec.step(i))
    want = list(range(4)) + list(range(84, 100))
    assert all(cache.kept_positions()[0, h].tolist() == want for h in range(3))


@settings(max_examples=80, deadline=None)
@given(average=st.integers(0, 5000), layers=st.integers(1, 80), depth=st.floats(1.0, 50.0))
def test_pyramid_budgets_preserve_the_total_and_decrease(average, layers, depth):
    b = pyramid_budgets(average, layers, depth)
    assert len(b) == layers
    assert sum(b) == average * layers
    assert all(x >= 0 for x in b)
    assert all(b[i] >= b[i + 1] - 1 for i in range(layers - 1))  # linear, up to rounding
    if layers > 1:
        assert b[0] >= b[-1]


def test_pyramid_depth_one_is_uniform_and_layer_budgets_sum():
    assert pyramid_budgets(100, 7, 1.0) == [100] * 7
    cfg = PyramidKVConfig(budget=300, sink_tokens=16, recent_tokens=64, pyramid_depth=4.0)
    budgets = [cfg.layer_budget(i, 30) for i in range(30)]
    assert sum(budgets) == 300 * 30
    assert budgets[0] > budgets[-1] >= 80
    with pytest.raises(ConfigError, match="pyramid_depth"):
        PyramidKVConfig(budget=300, pyramid_depth=0.5)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    heads=st.integers(1, 4),
    total=st.integers(0, 150),
    floor=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_adaptive_head_budgets(n, heads, total, floor, seed):
    scores = torch.rand(2, heads, n, generator=torch.Generator().manual_seed(seed))
    eff_total = min(total, heads * n)
    if min(floor, n) * heads > eff_total:
        with pytest.raises(ConfigError, match="min_per_head"):
            adaptive_head_budgets(scores, total, floor)
        return
    counts = adaptive_head_budgets(scores, total, floor)
    assert counts.shape == (2, heads)
    assert (counts.sum(-1) == eff_total).all()
    assert (counts >= min(floor, n)).all() and (counts <= n).all()
    if floor == 0:  # brute force: the eff_total largest normalised scores
        norm = scores / scores.sum(-1, keepdim=True)
        for b in range(2):
            flat = sorted((-norm[b, h, i].item(), h * n + i) for h in range(heads) for i in range(n))[:eff_total]
            want = [sum(1 for _, j in flat if j // n == h) for h in range(heads)]
            assert counts[b].tolist() == want


def test_adaptive_cache_shares_the_layer_budget_between_heads():
    vec = layer_vectors(10, tokens=180, head_dim=16)
    cfg = H2OConfig(budget=40, sink_tokens=4, recent_tokens=8, head_budgets="adaptive", min_head_tokens=2)
    cache = cfg.make_layer(0, 1)
    cache.prefill(*vec.prefix(150))
    for i in range(150, 180):
        cache.decode(*vec.step(i))
        held = cache.tokens_held()
        assert int(held.sum()) == 3 * 40
        assert (held >= 4 + 8 + 2).all()
        pos = cache.kept_positions()
        for h in range(3):
            kept = [p for p in pos[0, h].tolist() if p >= 0]
            assert set(range(i - 7, i + 1)) <= set(kept) and set(range(4)) <= set(kept)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="budget=10"):
        H2OConfig(budget=10, sink_tokens=8, recent_tokens=8)
    with pytest.raises(ConfigError, match="pool_kernel"):
        SnapKVConfig(budget=256, pool_kernel=4)
    with pytest.raises(ConfigError, match="head_budgets"):
        H2OConfig(budget=256, head_budgets="fancy")
    with pytest.raises(ConfigError, match="window"):
        SnapKVConfig(budget=256, window=0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    block=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 10_000),
    sinks=st.integers(0, 8),
    recent=st.integers(0, 20),
    extra=st.integers(0, 100),
)
def test_span_selection_keeps_the_best_whole_spans(n, block, seed, sinks, recent, extra):
    """Brute force: whole spans only (plus the trailing partial one), sink and recent spans kept,
    and the rest of the budget the highest-summed spans (ties to the earlier span)."""
    full, partial = divmod(n, block)
    sink_b, recent_b = -(-sinks // block), -(-max(recent - partial, 0) // block)
    budget = (sink_b + recent_b) * block + partial + extra
    scores = torch.rand(1, 2, n, generator=torch.Generator().manual_seed(seed))
    got = keep_block_indices(scores, budget, sinks, recent, block)
    if budget >= n:
        assert got[0, 0].tolist() == list(range(n))
        return
    budget_b = (budget - partial) // block
    for h in range(2):
        kept = got[0, h].tolist()
        assert kept == sorted(kept) and len(kept) == budget_b * block + partial <= budget
        spans = sorted({i // block for i in kept if i < full * block})
        assert all(i in kept for sp in spans for i in range(sp * block, sp * block + block))
        assert all(i in kept for i in range(full * block, n))  # the partial span
        sums = scores[0, h, : full * block].reshape(full, block).sum(-1).tolist()
        protected = set(range(sink_b)) | set(range(full - recent_b, full))
        middle = sorted(set(range(full)) - protected, key=lambda b: (-sums[b], b))
        want = sorted(protected | set(middle[: budget_b - len(protected)]))
        assert spans == want


def test_span_selection_names_a_budget_without_room():
    with pytest.raises(ConfigError, match="budget"):
        keep_block_indices(torch.rand(1, 1, 100), 40, 16, 32, 16)


@settings(max_examples=40, deadline=None)
@given(block=st.sampled_from([1, 4, 16, 32]), sinks=st.integers(0, 40), recent=st.integers(0, 80))
def test_span_floor_is_the_smallest_budget_every_length_accepts(block, sinks, recent):
    """Brute force over every sequence length (the partial span changes with each decoded
    token): the floor has room at all of them, one token less is refused at some length."""
    floor = span_budget_floor(block, sinks, recent)

    def refused(budget: int) -> bool:
        for n in range(budget + 1, budget + 2 * block + 2):
            try:
                keep_block_indices(torch.rand(1, 1, n), budget, sinks, recent, block)
            except ConfigError:
                return True
        return False

    assert not refused(floor)
    assert floor == 0 or refused(floor - 1)


def test_block_wise_configs_refuse_budgets_a_later_step_would_refuse():
    """SnapKV spans of 32 with 16 sinks and 64 recent tokens need 127 (one sink span, the recent
    spans and a partial span of up to 31 tokens): 96 has room only at whole-span lengths, so it
    is refused at config time, naming the field and the floor; at 127 a generation runs every
    decode step of a partial span without error."""
    with pytest.raises(ConfigError, match=r"budget=96 .*\[127, .*block_size=32"):
        SnapKVConfig(budget=96, block_size=32)
    cache = SnapKVConfig(budget=127, block_size=32, window=16).make_layer(0, 1)
    vec = layer_vectors(5, tokens=256 + 40)
    cache.prefill(*vec.prefix(256))
    for t in range(256, 256 + 40):
        cache.decode(*vec.step(t))
        assert cache.kept_positions().shape[-1] <= 127
    with pytest.raises(ConfigError, match="representatives"):
        KVCrushConfig(budget=127, block_size=32, representatives=32)


def test_snapkv_in_spans_holds_whole_spans_within_its_budget():
    """The layer cache with ``block_size`` holds whole 16-token spans (and the partial tail) and no
    more than its budget, where token-wise SnapKV holds scattered tokens."""
    vec = layer_vectors(4, tokens=256)
    cfg_tok = SnapKVConfig(budget=96, sink_tokens=4, recent_tokens=32, window=16)
    cfg_span = SnapKVConfig(budget=96, sink_tokens=4, recent_tokens=32, window=16, block_size=16)
    for cfg in (cfg_tok, cfg_span):
        cache = cfg.make_layer(0, 1)
        cache.prefill(*vec.prefix(256))
        held = cache.kept_positions()[0]
        whole = all(
            all(p in row for s in {p // 16 for p in row} for p in range(16 * s, 16 * s + 16)) for row in held.tolist()
        )
        assert whole is (cfg.block_size is not None)
        assert held.shape[-1] <= 96


def test_span_pooling_default_keeps_both_halves_of_a_needle_a_span_boundary_splits():
    """Spans pool over 31 tokens by default: the window's attention lands on a needle's first
    tokens at the end of span 2 (90-95); its last tokens open span 3 and get little attention.
    Pooled over 7 tokens, span 3 ranks below two spans of spread-out attention and is evicted;
    pooled over 31, span 3 inherits the needle's score and both spans stay."""
    assert SnapKVConfig(budget=256, block_size=32).pool_width == 31
    assert KVCrushConfig(budget=256, block_size=32).pool_width == 31
    assert SnapKVConfig(budget=256, block_size=32, pool_kernel=7).pool_width == 7
    assert SnapKVConfig(budget=256, block_size=32).op_fields(1, 9, 32)["pool_kernel"] == 31
    raw = torch.full((1, 1, 256), 0.01)
    raw[..., 90:96] = 1.0  # the needle's phrase, at the end of span 2
    raw[..., 160:224] = 0.15  # spans 5 and 6: attention spread over many tokens
    spans = {}
    for width in (7, SnapKVConfig(budget=256, block_size=32).pool_width):
        kept = keep_block_indices(pool_scores(raw, width), 96, 0, 32, 32)[0, 0]
        spans[width] = sorted({int(p) // 32 for p in kept})
    assert spans[7] == [2, 5, 7]  # span 3, the needle's tail, is gone
    assert spans[31] == [2, 3, 7]


def test_token_pooling_default_keeps_a_needles_digits_the_window_barely_attends():
    """Single tokens pool over 31 by default too (SnapKV's paper: 7): the window attends the
    needle's phrase (90-95); its digits (96-102) get no more than the haystack. Pooled over 7,
    the last digits rank below a region of spread-out attention and are evicted; pooled over 31
    the whole number inherits the phrase's score and is kept."""
    assert SnapKVConfig(budget=96).pool_width == 31
    assert SnapKVConfig(budget=96, pool_kernel=7).pool_width == 7
    assert KVCrushConfig(budget=96).op_fields(1, 9, 32)["pool_kernel"] == 31
    raw = torch.full((1, 1, 256), 0.01)
    raw[..., 90:96] = 1.0  # the phrase before the number
    raw[..., 150:230] = 0.15  # attention spread over a long region
    digits = set(range(96, 103))
    kept = {}
    for width in (7, SnapKVConfig(budget=96).pool_width):
        kept[width] = {int(p) for p in keep_indices(pool_scores(raw, width), 48, 0, 8)[0, 0]}
    assert not digits <= kept[7]  # the number's tail is gone
    assert digits <= kept[31]


@pytest.mark.parametrize("bits", [2, 4])
def test_over_the_quantized_store_decode_drops_the_lowest_scoring_whole_chunks(bits):
    """Over the 2-/4-bit store a decode step drops whole ``residual_tokens`` chunks: once a head
    holds a chunk more than its budget, the chunk with the lowest summed scores among those that
    hold no sink and none of the recent tokens (brute force over the scores before the step's
    eviction); what stays dequantizes to the same values, and the head never holds a chunk plus
    the recent window more than its budget (a frozen selection kept every generated token)."""
    from ov_kvcrush.methods import QuantSettings

    r, budget, sinks, recent = 32, 128, 4, 8
    quant = QuantSettings(bits=bits, residual_tokens=r, prompt_tail=16)
    vec = layer_vectors(8, tokens=400, head_dim=16)
    for cfg in (
        SnapKVConfig(budget=budget, sink_tokens=sinks, recent_tokens=recent, window=8, quant=quant),
        H2OConfig(budget=budget, sink_tokens=sinks, recent_tokens=recent, quant=quant),
        KVCrushConfig(budget=budget, sink_tokens=sinks, recent_tokens=recent, window=8, quant=quant),
        KVCrushConfig(budget=budget, sink_tokens=sinks, recent_tokens=recent, window=8, quant=quant, scope="head"),
    ):
        assert not cfg.selection_frozen()
        cache = cfg.make_layer(0, 1)
        cache.prefill(*vec.prefix(200))
        drops = 0
        for i in range(200, 400):
            nq_before = cache.store.quantized_tokens
            before_k, before_v, before_pos = cache.store.dense()
            cache.decode(*vec.step(i))
            k, v, pos = cache.store.dense()
            held = pos.shape[-1]
            if getattr(cfg, "scope", "head") == "layer":  # KVCrush per layer: every head the same tokens
                assert all(torch.equal(pos[0, h].sort().values, pos[0, 0].sort().values) for h in range(pos.shape[1]))
            assert budget <= held <= budget + r - 1 + recent, (cfg.name, i, held)
            if held < before_pos.shape[-1] + 1:  # chunks went: check which, head by head
                drops += 1
                acc = cache.acc  # one score per held token
                for h in range(pos.shape[1]):
                    kept = pos[0, h].tolist()
                    gone = sorted((set(before_pos[0, h].tolist()) | {i}) - set(kept))
                    assert len(gone) % r == 0 and gone
                    for p in gone:
                        assert sinks <= p <= i - recent, (p, i)
                    # what was quantized and stays is unchanged: the same values at the same positions
                    old = before_pos[0, h].tolist()
                    pairs = [(j, old.index(p)) for j, p in enumerate(kept) if p in old and old.index(p) < nq_before]
                    mine, where = [j for j, _ in pairs], [w for _, w in pairs]
                    assert mine
                    torch.testing.assert_close(k[0, h, mine], before_k[0, h, where], atol=0, rtol=0)
                    torch.testing.assert_close(v[0, h, mine], before_v[0, h, where], atol=0, rtol=0)
                assert acc.shape[-1] == held
        assert drops >= 3, (cfg.name, drops)


def test_over_the_quantized_store_the_dropped_chunk_scores_lowest():
    """The chunk that goes is the lowest by its tokens' summed scores (ties to the older), checked
    on the reference's own scores right before the eviction."""
    from ov_kvcrush.methods import QuantSettings
    from ov_kvcrush.methods.attention import group_heads

    r, budget, sinks, recent = 32, 96, 4, 8
    cfg = SnapKVConfig(
        budget=budget, sink_tokens=sinks, recent_tokens=recent, window=8, quant=QuantSettings(residual_tokens=r)
    )
    cache = cfg.make_layer(0, 1)
    vec = layer_vectors(3, tokens=420, head_dim=16)
    cache.prefill(*vec.prefix(260))
    checked = 0
    original = cache._evict_quantized_chunks

    def spy() -> None:
        nonlocal checked
        store = cache.store
        nq = store.quantized_tokens
        before = store.qpos.clone() if store.qpos is not None else None
        scores = group_heads(cache.acc[..., :nq], store.qpos.shape[1]) if nq else None
        original()
        if before is None or store.quantized_tokens == nq:
            return
        newest = int(store.positions.max())
        for h in range(before.shape[1]):
            chunks = before[0, h].reshape(-1, r)
            sums = scores[0, h].reshape(-1, r).sum(-1).tolist()
            movable = [c for c in range(len(chunks)) if chunks[c].min() >= sinks and chunks[c].max() <= newest - recent]
            dropped = sorted(set(before[0, h].tolist()) - set(store.qpos[0, h].tolist()))
            n_drop = len(dropped) // r
            expect = sorted(sorted(movable, key=lambda c: (sums[c], c))[:n_drop])
            assert dropped == sorted(p for c in expect for p in chunks[c].tolist())
            checked += 1

    cache._evict_quantized_chunks = spy
    for i in range(260, 420):
        cache.decode(*vec.step(i))
    assert checked >= 3 * cache.store.qpos.shape[1]


def test_minikv_and_knorm_stay_frozen_over_the_quantized_store():
    """MiniKV selects once by design (its paper keeps every generated token), Knorm ranks by key
    norms alone: over the store their prefill selection stays and every generated token is kept."""
    from ov_kvcrush.methods import QuantSettings, method_config

    quant = QuantSettings(residual_tokens=32)
    vec = layer_vectors(8, tokens=300, head_dim=16)
    for name in ("minikv", "knorm"):
        cfg = method_config(name, budget=96, sink_tokens=4, recent_tokens=8, quant=quant)
        assert cfg.selection_frozen()
        cache = cfg.make_layer(0, 1)
        cache.prefill(*vec.prefix(200))
        for i in range(200, 300):
            cache.decode(*vec.step(i))
        assert cache.tokens_held().max() == 96 + 100, name


@settings(max_examples=80, deadline=None)
@given(
    chunks=st.integers(0, 8),
    r=st.sampled_from([1, 2, 4]),
    drop=st.integers(0, 9),
    sinks=st.integers(0, 6),
    recent=st.integers(0, 10),
    ties=st.booleans(),
    seed=st.integers(0, 99),
)
def test_keep_chunk_indices_matches_brute_force(chunks, r, drop, sinks, recent, ties, seed):
    """Each head drops the same number of chunks: the fewest any head may drop (no sink's, no
    recent token's), up to ``drop``, its lowest-scoring ones, ties to the older chunk."""
    g = torch.Generator().manual_seed(seed)
    b, h = 1, 3
    scores = torch.randint(0, 3, (b, h, chunks), generator=g).float() if ties else torch.rand(b, h, chunks, generator=g)
    # each head holds increasing positions, chunk by chunk (heads differ)
    positions = torch.stack([torch.randperm(60, generator=g)[: chunks * r].sort().values for _ in range(h)])[None]
    newest = 60
    got = keep_chunk_indices(scores, positions, drop, sinks, newest - recent)
    stays = [
        [
            any(p < sinks or p > newest - recent for p in positions[0, i, c * r : (c + 1) * r].tolist())
            for c in range(chunks)
        ]
        for i in range(h)
    ]
    n = min([drop] + [stays[i].count(False) for i in range(h)]) if chunks else 0
    for i in range(h):
        movable = [c for c in range(chunks) if not stays[i][c]]
        gone = sorted(movable, key=lambda c: (float(scores[0, i, c]), c))[:n]
        assert got[0, i].tolist() == [c for c in range(chunks) if c not in gone]
