"""ClusterKV inside the C++ op against its torch reference, on the shared test vectors.

ClusterKV evicts nothing, so what must match is what each decode step *attends*: for the same
keys and queries the op's k-means gives the reference's labels, each step recalls the same
clusters (whole, the last trimmed to its earliest tokens) plus sinks and pending tokens, and the
attention over that working set gives the reference's output. The recall cache changes the work
(tokens gathered), never the result, and its hit counts are the reference's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import HKV, HQ, D, drive, held_positions

from ov_kvcrush.methods import QuantSettings, method_config
from ov_kvcrush.methods.clusterkv import init_order, kmeans_cosine
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache, plugin
from ov_kvcrush.op.method_spec import method_spec

BASE = dict(budget=96, sink_tokens=4, tokens_per_cluster=16, new_clusters=2, cluster_every=12, dense_layers=1)
CASES = {
    "clusterkv": {},
    "no-cache": dict(recall_cache_steps=0),
    "cache-3": dict(recall_cache_steps=3),
    "fixed-clusters": dict(n_clusters=5, seed=11),
    "quant": dict(quant=QuantSettings(residual_tokens=32)),
    "budget-above-context": dict(budget=4000),
}


def test_init_order_and_kmeans_match_the_reference():
    """Same seeded initial picks and, from there, the same labels and centroids, head by head."""
    for seed, row, n, k in [(0, 0, 10, 10), (5, 2, 300, 17), (2**31 - 1, 7, 1000, 40)]:
        want = init_order(seed, row + 1, n)[row, :k].tolist()
        # the op's init_order is only reachable through k-means: k-means with one iteration keeps
        # the initial directions, so each picked vector is labelled with its own cluster
        x = np.random.default_rng(seed % 97).standard_normal((n, 8)).astype(np.float32)
        km1 = kvcache.kmeans(x, k, max_iters=1, seed=seed, row=row)
        assert km1.iterations == 1
        assert [int(km1.labels[i]) for i in want] == list(range(len(want)))
    keys = layer_vectors(3, tokens=700).keys[0]  # [3, 700, 64]
    km = kmeans_cosine(keys, 20, max_iters=40, seed=9)
    for h in range(3):
        op = kvcache.kmeans(keys[h].numpy(), 20, max_iters=40, seed=9, row=h)
        assert op.iterations <= km.iterations
        np.testing.assert_array_equal(op.labels, km.labels[h].numpy())
        np.testing.assert_array_equal(op.sizes, km.sizes[h].numpy())
        np.testing.assert_allclose(op.centroids, km.centroids[h].numpy(), atol=2e-6)


@pytest.mark.parametrize(("n", "k", "d"), [(3000, 40, 64), (2000, 300, 64), (900, 7, 16), (5000, 1100, 32)])
def test_kmeans_bounds_equal_brute_force(n, k, d):
    """The group bounds skip rows and centroid groups without changing a label, an iteration count
    or a centroid: the same result as recomputing every similarity at every iteration. Clustered
    keys (a few directions plus noise) keep labels moving for many iterations, near-ties included;
    k = 1100 makes several tiles per bound group."""
    rng = np.random.default_rng(n + k)
    centres = rng.standard_normal((12, d)).astype(np.float32)
    x = centres[rng.integers(0, 12, n)] + 0.6 * rng.standard_normal((n, d)).astype(np.float32)
    x[::97] = x[1::97][: len(x[::97])]  # exact duplicates: equal similarities, ties by index
    fast = kvcache.kmeans(x, k, max_iters=20, seed=3)
    brute = kvcache.kmeans(x, k, max_iters=20, seed=3, bounded=False)
    assert fast.iterations == brute.iterations
    np.testing.assert_array_equal(fast.labels, brute.labels)
    np.testing.assert_array_equal(fast.sizes, brute.sizes)
    np.testing.assert_array_equal(fast.centroids, brute.centroids)
    assert brute.rows_assigned == n * brute.iterations
    if brute.iterations > 3:  # the bounds must actually save work once labels settle
        assert fast.rows_assigned < brute.rows_assigned


def test_kmeans_rejects_bad_arguments():
    with pytest.raises(plugin.PluginError, match="at least one vector"):
        kvcache.kmeans(np.zeros((0, 8), np.float32), 3)
    with pytest.raises(plugin.PluginError, match="max_iters"):
        kvcache.kmeans(np.ones((4, 8), np.float32), 3, max_iters=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer", [0, 2])
def test_op_recalls_the_reference_tokens(ov_core, case, layer):
    """Every decode step attends the reference's working set, with the reference's output."""
    fields = {**BASE, **CASES[case]}
    cfg = method_config("clusterkv", **fields)
    dense = layer < cfg.dense_layers
    steps = [200] + [1] * 40
    hits = lookups = 0
    for s, out, ref, seq, pool, lc in drive(ov_core, cfg, layer=layer, steps=steps):
        np.testing.assert_allclose(out, ref, atol=3e-5, rtol=0, err_msg=f"{case} step {s}")
        got = held_positions(seq, layer)
        for g in range(HKV):  # nothing is evicted: every token stays in the store
            np.testing.assert_array_equal(np.sort(got[g]), np.arange(sum(steps[: s + 1])))
        st = seq.stats()
        ps = pool.stats()
        assert ps.kv_bytes == st.kv_bytes == st.blocks_held * pool.block_bytes + st.qblocks_held * ps.qblock_bytes
        if dense:  # the dense layers attend everything, with no cluster state
            assert seq.cluster_stats(layer, 0).clusters == 0
            continue
        if s == 0:
            assert seq.cluster_stats(layer, 0).clusters == math.ceil((200 - 4) / 16) or cfg.n_clusters
            continue
        want = lc.last_selected[0]
        for g in range(HKV):
            rec = seq.recalled(layer, g)
            np.testing.assert_array_equal(rec, np.sort(want[g].numpy()), err_msg=f"{case} step {s} head {g}")
            cs = seq.cluster_stats(layer, g)
            # the working set: sinks + recalled (exactly the budget, or everything clustered) + pending
            clustered, pending = cs.pending_from - cs.sinks, sum(steps[: s + 1]) - cs.pending_from
            assert rec.size == cs.sinks + min(cfg.budget - cs.sinks, clustered) + pending
            assert rec.size <= cfg.budget + cfg.cluster_every + 1
        cs = [seq.cluster_stats(layer, g) for g in range(HKV)]
        lookups, hits = sum(c.lookups for c in cs), sum(c.hits for c in cs)
        assert lookups == lc.counters.get("cluster_lookups", 0)
        assert hits == lc.counters.get("cluster_hits", 0)
        assert sum(c.tokens_loaded for c in cs) == lc.counters.get("tokens_loaded", 0)
        assert sum(c.clusterings for c in cs) == HKV * lc.counters["clusterings"]
    if not dense:
        labels = seq.cluster_labels(layer, 0)
        np.testing.assert_array_equal(labels, lc.index.labels[0].numpy())
        assert lc.counters["clusterings"] >= 3  # the prompt, then every cluster_every generated tokens
        if cfg.recall_cache_steps and cfg.budget < 200:
            assert 0 < hits < lookups
        if not cfg.recall_cache_steps:
            assert hits == 0


def test_recall_cache_saves_gathering_not_results(ov_core):
    """Over the 2-bit store, recalled clusters are dequantized into the working set: with the cache
    far fewer tokens are gathered, the outputs are the same. A full-precision store is kept
    cluster by cluster and attended in place: nothing is gathered at all."""
    outs, gathered = {}, {}
    for r, quant in [(0, True), (4, True), (1, False)]:
        extra = {"quant": QuantSettings(residual_tokens=32)} if quant else {}
        cfg = method_config("clusterkv", **{**BASE, "recall_cache_steps": r, **extra})
        runs = list(drive(ov_core, cfg, layer=2, steps=[240] + [1] * 30))
        outs[r] = np.stack([o for _, o, *_ in runs[1:]])
        seq = runs[-1][3]
        gathered[r] = sum(seq.cluster_stats(2, g).gathered for g in range(HKV))
        assert (seq.cluster_stats(2, 0).working_set_bytes > 0) == quant
    np.testing.assert_array_equal(outs[0], outs[4])
    assert 0 < gathered[4] < gathered[0] / 2
    assert gathered[1] == 0


@pytest.mark.parametrize("precision", ["f32", "f16"])
def test_multi_token_steps(ov_core, precision):
    """Chat-style steps of several tokens: causal inside the pending tokens, clusters ranked by
    the queries summed over the step; over an f32 store (exact) and an f16 one (rounded keys)."""
    cfg = method_config("clusterkv", **BASE)
    steps = [150, 5, 1, 7, 1, 16, 3]
    for s, out, ref, seq, _, lc in drive(ov_core, cfg, layer=1, steps=steps, precision=precision):
        tol = 3e-5 if precision == "f32" else 1e-2
        np.testing.assert_allclose(out, ref, atol=tol, rtol=0, err_msg=f"step {s}")
        if s and precision == "f32":
            for g in range(HKV):
                np.testing.assert_array_equal(seq.recalled(1, g), np.sort(lc.last_selected[0, g].numpy()))
    assert seq.cluster_stats(1, 0).clusterings == 3


def test_truncate_into_clustered_tokens_is_refused(ov_core):
    cfg = method_config("clusterkv", **BASE)
    seq = list(drive(ov_core, cfg, layer=1, steps=[100, 1, 1]))[-1][3]
    seq.truncate(101)  # a pending token: allowed
    with pytest.raises(plugin.PluginError, match="ClusterKV"):
        seq.truncate(50)
    seq.reset()
    assert seq.stats().tokens_held == 0


def test_scores_and_bad_budgets_are_refused():
    spec = method_spec(method_config("clusterkv", **BASE), 4, HQ, 32)
    with pytest.raises(plugin.PluginError, match="scores"):
        kvcache.KVPool(4, HQ, HKV, D, method=spec, scores=True)
    with pytest.raises(plugin.PluginError, match="budgets"):
        one_layer = method_spec(method_config("clusterkv", **dict(BASE, dense_layers=0)), 1, HQ, 32)
        kvcache.KVPool(1, HQ, HKV, D, method=one_layer.replace("budgets=96", "budgets=4"))
    with pytest.raises(Exception, match="track_recall"):
        method_spec(method_config("clusterkv", budget=64, track_recall=True), 4, HQ, 32)


def test_clustering_cost_is_counted_in_prefill_policy_time(ov_core):
    cfg = method_config("clusterkv", **BASE)
    seq = list(drive(ov_core, cfg, layer=1, steps=[300]))[-1][3]
    st = seq.stats()
    assert st.policy_prefill_ns > 0
    cs = seq.cluster_stats(1, 0)
    assert cs.clusters == math.ceil((300 - 4) / 16) and cs.kmeans_iterations >= 1
    assert cs.sinks == 4 and cs.pending_from == 300 and cs.steps == 0
