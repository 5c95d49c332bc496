"""Chelsea: chunked soft matching, degree-weighted merging, the log(degree) attention identity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import ChelseaConfig, FullConfig
from ov_kvcrush.methods.attention import attend
from ov_kvcrush.methods.base import storage_bytes
from ov_kvcrush.methods.chelsea import (
    PROTECT_POOL_KERNEL,
    PROTECT_WINDOW,
    calibrate_outlier_heads,
    chelsea_compress,
    chunked_soft_matching,
    merge_links,
    merged_budget,
)
from ov_kvcrush.methods.selection import snapkv_scores
from ov_kvcrush.methods.vectors import layer_vectors


def test_links_are_the_most_similar_b_token_of_the_same_chunk():
    keys = torch.randn(2, 37, 8, generator=torch.Generator().manual_seed(0))
    links = chunked_soft_matching(keys, 8)
    kn = F.normalize(keys, dim=-1)
    a_all = [i for i in range(37) if (i % 8) % 2 == 0]
    assert links.a[0].tolist() == a_all
    for h in range(2):
        for e, a in enumerate(a_all):
            chunk = a // 8
            bs = [j for j in range(chunk * 8, min(chunk * 8 + 8, 37)) if (j % 8) % 2 == 1]
            if not bs:
                assert links.similarity[h, e] == float("-inf")  # token 36 sits alone in its chunk
                continue
            sims = [float(kn[h, a] @ kn[h, j]) for j in bs]
            best = bs[max(range(len(bs)), key=lambda i: (sims[i], -i))]
            assert int(links.b[h, e]) == best
            assert float(links.similarity[h, e]) == pytest.approx(max(sims), abs=1e-6)


def test_merge_is_degree_weighted_and_keeps_the_strongest_links():
    keys = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(1))
    values = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(2))
    degrees = torch.tensor([[1.0, 2.0, 3.0, 1.0, 2.0, 1.0, 1.0, 4.0]])
    links = chunked_soft_matching(keys, 8)
    k, v, w, kept = merge_links(keys, values, degrees, links, 2)
    strongest = sorted(range(4), key=lambda e: (-float(links.similarity[0, e]), e))[:2]
    gone = {int(links.a[0, e]) for e in strongest}
    assert kept[0].tolist() == [i for i in range(8) if i not in gone]
    assert float(w.sum()) == float(degrees.sum())
    for j, tok in enumerate(kept[0].tolist()):
        members = [tok] + [int(links.a[0, e]) for e in strongest if int(links.b[0, e]) == tok]
        wsum = sum(float(degrees[0, m]) for m in members)
        want_k = sum(degrees[0, m] * keys[0, m] for m in members) / wsum
        want_v = sum(degrees[0, m] * values[0, m] for m in members) / wsum
        torch.testing.assert_close(k[0, j], want_k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v[0, j], want_v, rtol=1e-5, atol=1e-6)
        assert float(w[0, j]) == wsum


def test_log_degree_attention_is_exact_when_clusters_hold_identical_tokens():
    """Paper eq. 2: merging copies of a token and adding log(degree) changes nothing."""
    g = torch.Generator().manual_seed(3)
    base_k, base_v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
    rep = torch.tensor([i // 2 for i in range(120)])  # every token twice in a row: A/B twins
    keys, values = base_k[:, :, rep], base_v[:, :, rep]
    q = torch.randn(1, 4, 1, 16, generator=g)
    exact = attend(q, keys, values).output
    ck, cv, cw, _, _ = chelsea_compress(
        keys.reshape(2, 120, 16), values.reshape(2, 120, 16), torch.ones(2, 120), 64, 4, 4, 16
    )
    assert ck.shape[1] == 64
    merged = attend(q, ck.reshape(1, 2, 64, 16), cv.reshape(1, 2, 64, 16), bias=cw.reshape(1, 2, 64).log()).output
    torch.testing.assert_close(merged, exact, rtol=1e-5, atol=1e-6)
    unbiased = attend(q, ck.reshape(1, 2, 64, 16), cv.reshape(1, 2, 64, 16)).output
    assert not torch.allclose(unbiased, exact, atol=1e-4)  # the bias is what makes it exact


def test_degrees_sum_to_tokens_seen_across_repeated_merges():
    vec = layer_vectors(4, tokens=400)
    cfg = ChelseaConfig(budget=100, sink_tokens=8, recent_tokens=16, chunk_size=32, merge_interval=10)
    cache = cfg.make_layer(0, 1)
    cache.prefill(*vec.prefix(300))
    for i in range(300, 400):
        cache.decode(*vec.step(i))
        assert torch.allclose(cache.degrees.sum(-1), torch.full((1, 3), float(i + 1)))
        assert cache.degrees.shape[-1] < 100 + 10
    pos = cache.store.positions[0]
    assert all(pos[h, :8].tolist() == list(range(8)) for h in range(3))  # sinks untouched
    assert all(pos[h, -16:].tolist() == list(range(pos[h, -1] - 15, pos[h, -1] + 1)) for h in range(3))
    assert cache.counters["merges"] == 3 * (400 - cache.degrees.shape[-1])


def test_the_paper_schedule_caps_each_pass():
    """r = r_init - alpha * min(m, i): pass i merges at most floor(r * middle) links (at least one),
    so a compression takes more passes, and still reaches the budget with degrees summing to n."""
    from ov_kvcrush.methods.chelsea import chelsea_compress, pass_cap

    assert [pass_cap(1000, i, 3500, 1000, 2) for i in range(5)] == [350, 250, 150, 150, 150]
    assert pass_cap(1000, 9, 500, 1000, 3) == 1 and pass_cap(1000, 0, 0, 0, 0) == 1000
    vec = layer_vectors(5, tokens=300)
    k, v = vec.keys[0], vec.values[0]
    w = torch.ones(3, 300)
    free = chelsea_compress(k, v, w, 100, 8, 16, 32)
    paced = chelsea_compress(k, v, w, 100, 8, 16, 32, (3500, 1000, 2))
    assert free[0].shape[1] == paced[0].shape[1] == 100 and paced[4] > free[4]
    assert torch.allclose(paced[2].sum(-1), torch.full((3,), 300.0))
    with pytest.raises(ConfigError, match="merge_ratio"):
        ChelseaConfig(budget=256, merge_ratio=0.6)


def test_value_aware_links_merge_alike_keys_with_different_values_last():
    """Two pairs with identical keys: the pair whose values differ is the key-only ranking's
    favourite, and the value-aware ranking's last choice."""
    from ov_kvcrush.methods.chelsea import chunked_soft_matching

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 8, 16, generator=gen)
    v = torch.randn(1, 8, 16, generator=gen)
    k[0, 1] = k[0, 0]  # pair 0-1: identical keys, different values (a needle's two digits)
    k[0, 3] = k[0, 2] + 0.05 * torch.randn(16, generator=gen)  # pair 2-3: near keys, identical values
    v[0, 3] = v[0, 2]
    key_only = chunked_soft_matching(k, 8)
    both = chunked_soft_matching(k, 8, v)
    assert int(key_only.b[0, 0]) == 1 and int(both.b[0, 0]) == 1  # the B choice is the keys'
    assert key_only.similarity[0, 0] >= key_only.similarity[0, 1]
    assert both.similarity[0, 0] < both.similarity[0, 1]
    assert torch.all(both.similarity <= key_only.similarity + 1e-6)


def test_outlier_heads_keep_their_full_cache():
    vec = layer_vectors(5, tokens=300)
    cfg = ChelseaConfig(budget=64, sink_tokens=4, recent_tokens=8, chunk_size=16, outlier_heads=((0, 1),))
    cache = cfg.make_layer(0, 2)
    full = FullConfig().make_layer(0, 1)
    cache.prefill(*vec.prefix(250))
    full.prefill(*vec.prefix(250))
    for i in range(250, 300):
        out, ref = cache.decode(*vec.step(i)), full.decode(*vec.step(i))
        torch.testing.assert_close(out[:, 3:6], ref[:, 3:6], rtol=1e-5, atol=1e-5)  # q heads of kv head 1
    assert cache.tokens_held()[0].tolist()[1] == 300 and cache.tokens_held()[0, 0] < 64 + 32
    assert cfg.make_layer(1, 2).outlier_heads == ()


@pytest.mark.parametrize("seen", [0, 50, 64, 100, 500, 3000, 10**6])
def test_merged_budget_is_the_largest_share_within_the_whole_budget(seen):
    """Brute force: the largest per-head count whose merged heads plus the outliers' whole caches
    stay within budget x heads (never below the floor, the budget without outliers)."""
    budget, heads, floor = 64, 12, 21
    assert merged_budget(budget, seen, heads, 0, floor) == budget
    for k in (1, 2, 5):
        fits = [b for b in range(0, 10 * budget) if k * seen + (heads - k) * b <= budget * heads]
        assert merged_budget(budget, seen, heads, k, floor) == max(floor, max(fits, default=floor))


def test_outlier_heads_count_against_the_budget():
    """Over all layers, a cache with outlier heads holds about what one without them holds: the
    merged heads keep less as the outliers grow (the paper's accounting)."""
    vec = layer_vectors(6, tokens=400)
    base = dict(budget=128, sink_tokens=4, recent_tokens=8, chunk_size=16, merge_interval=8)
    layers, kv_heads = 4, vec.keys.shape[1]

    def held(cfg):
        caches = [cfg.make_layer(i, layers) for i in range(layers)]
        for c in caches:
            c.prefill(*vec.prefix(300))
            for i in range(300, 400):
                c.decode(*vec.step(i))
        return torch.stack([c.tokens_held()[0] for c in caches])  # [layers, kv_heads]

    plain = held(ChelseaConfig(**base))
    cfg = ChelseaConfig(**base, outlier_heads=((0, 1), (1, 2)))
    with_outliers = held(cfg)
    assert with_outliers[0, 1] == with_outliers[1, 2] == 400  # whole
    target = cfg.merged_budget(400, layers * kv_heads)
    assert target == (128 * layers * kv_heads - 2 * 400) // (layers * kv_heads - 2) < 128
    merged = [with_outliers[i, h] for i in range(layers) for h in range(kv_heads) if (i, h) not in cfg.outlier_heads]
    assert all(target <= int(n) < target + base["merge_interval"] for n in merged)
    slack = len(merged) * base["merge_interval"]  # a head merges only every merge_interval tokens
    assert int(with_outliers.sum()) <= 128 * layers * kv_heads + slack
    assert int(plain.sum()) <= 128 * layers * kv_heads + layers * kv_heads * base["merge_interval"]


def test_protected_tokens_are_the_windows_favourites_kept_exact():
    """protect_tokens: per head, the middle tokens the prompt's last 32 queries attend most (pooled
    over 31, summed over the head's group) are held exactly (degree 1, their own keys and values)
    and count against the budget; the others merge as Chelsea does, over their own sequence."""
    vec = layer_vectors(7, tokens=300)
    q, k, v = vec.prefix(300)
    cfg = ChelseaConfig(budget=96, sink_tokens=4, recent_tokens=16, chunk_size=32, protect_tokens=24)
    cache = cfg.make_layer(0, 1)
    cache.prefill(q, k, v)
    hk, g = k.shape[1], q.shape[1] // k.shape[1]
    window = snapkv_scores(q, k, PROTECT_WINDOW, PROTECT_POOL_KERNEL, "max").view(1, hk, g, -1).sum(2)
    held_k, held_v, held_p = cache.store.dense()
    assert held_p.shape[-1] == 96  # the budget, protected tokens included
    for h in range(hk):
        middle = window[0, h, 4:284]
        favourites = (torch.argsort(middle, descending=True, stable=True)[:24] + 4).tolist()
        pos = held_p[0, h].tolist()
        assert pos == sorted(pos)  # back in position order
        for t in favourites:
            slot = pos.index(t)
            assert cache.degrees[0, h, slot] == 1.0
            torch.testing.assert_close(held_k[0, h, slot], k[0, h, t])
            torch.testing.assert_close(held_v[0, h, slot], v[0, h, t])
    assert float(cache.degrees.sum()) == 300 * hk
    assert storage_bytes([cache]) == cache.memory()["total"]  # the scores it ranks by are counted
    plain = ChelseaConfig(budget=96, sink_tokens=4, recent_tokens=16, chunk_size=32, protect_tokens=0).make_layer(0, 1)
    plain.prefill(q, k, v)
    exact = [int((plain.degrees[0, h] == 1).sum()) for h in range(hk)]
    assert all(int((cache.degrees[0, h] == 1).sum()) > exact[h] for h in range(hk))


def test_the_default_protects_three_quarters_of_the_budget_and_the_paper_is_a_preset():
    """The default keeps the window's favourites out of merging (the form that answers needles);
    ``preset=paper`` is the paper's merge; a set count is kept, and a compression keeps at most
    what its budget leaves after the sinks, the recent tokens and one merged token."""
    from ov_kvcrush.methods import method_config

    assert ChelseaConfig(budget=1024).protected_tokens == 768
    assert method_config("chelsea", budget=1024, preset="paper").protected_tokens == 0
    assert ChelseaConfig(budget=1024, protect_tokens=100).protected_tokens == 100
    vec = layer_vectors(7, tokens=300)
    cache = ChelseaConfig(budget=96, sink_tokens=4, recent_tokens=16, chunk_size=32).make_layer(0, 1)
    cache.prefill(*vec.prefix(300))
    held = [int((cache.degrees[0, h] == 1).sum()) for h in range(cache.degrees.shape[1])]
    assert all(n >= 4 + 16 + 72 for n in held)  # the sinks, the recent tokens and the 72 protected: exact


def test_calibration_finds_the_head_whose_keys_do_not_match():
    vec = layer_vectors(6, tokens=256)
    keys = vec.keys.clone()
    keys[:, 2] = torch.randn(1, 256, 64, generator=torch.Generator().manual_seed(9))  # unstructured head
    assert calibrate_outlier_heads([keys], chunk_size=64, threshold=0.8, ratio=0.34) == ((0, 2),)


def test_config_validation():
    with pytest.raises(ConfigError, match="chunk_size"):
        ChelseaConfig(budget=256, chunk_size=7)
    with pytest.raises(ConfigError, match="budget"):
        ChelseaConfig(budget=80)
    with pytest.raises(ConfigError, match="outlier_heads"):
        ChelseaConfig(budget=256, outlier_heads=((0,),))
    with pytest.raises(ConfigError, match="protect_tokens"):
        ChelseaConfig(budget=256, protect_tokens=-1)
