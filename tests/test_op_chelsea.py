"""Chelsea inside the C++ op against its torch reference, on the shared test vectors.

For the same keys, the op's chunked soft matching merges the same tokens as the reference
(every held token is the reference's, by position, with the reference's degree), the merged keys
and values are the reference's degree-weighted means, and attention with log(degree) added to
the logits gives the reference's output, step after step; outlier heads stay whole.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import HKV, HQ, D, drive, op_model

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import QuantSettings, method_config
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache, plugin
from ov_kvcrush.op.method_spec import method_spec

BASE = dict(budget=96, sink_tokens=4, recent_tokens=16, chunk_size=32, merge_interval=8)
CASES = {
    "chelsea": {},  # the default: three quarters of the budget kept out of merging
    "paper": dict(protect_tokens=0),
    "odd-chunks": dict(chunk_size=18, merge_interval=5),
    "outliers": dict(outlier_heads=((1, 0), (2, 2))),
    "one-chunk": dict(chunk_size=256, budget=120, merge_interval=16),
    "paper-schedule": dict(merge_ratio=0.35, ratio_decay=0.1, decay_steps=2),
    "key-value-links": dict(link_score="key_value"),
    "protect": dict(protect_tokens=24),
    "protect-outliers-schedule": dict(protect_tokens=40, outlier_heads=((1, 1),), merge_ratio=0.25),
}


def reference_heads(lc, kv_heads):
    """Per KV head of a reference layer: (positions, degrees, keys, values) in slot order."""
    out = {}
    if lc.merged_heads:
        k, v, p = lc.store.dense()
        for j, h in enumerate(lc.merged_heads):
            out[h] = (p[0, j].numpy(), lc.degrees[0, j].numpy(), k[0, j].numpy(), v[0, j].numpy())
    if lc.outlier_heads:
        k, v, p = lc.full.dense()
        for j, h in enumerate(lc.outlier_heads):
            out[h] = (p[0, j].numpy(), np.ones(p.shape[-1], np.float32), k[0, j].numpy(), v[0, j].numpy())
    return [out[h] for h in range(kv_heads)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer", [1, 2])
def test_op_merges_like_the_reference(ov_core, case, layer):
    cfg = method_config("chelsea", **{**BASE, **CASES[case]})
    steps = [300] + [1] * 30 + [5, 1, 1]
    compressions = 0
    for s, out, ref, seq, pool, lc in drive(ov_core, cfg, layer=layer, steps=steps):
        np.testing.assert_allclose(out, ref, atol=5e-5, rtol=0, err_msg=f"{case} step {s}")
        for g, (pos, deg, keys, values) in enumerate(reference_heads(lc, HKV)):
            got_pos, got_k, got_v, _ = seq.read_head(layer, g)
            np.testing.assert_array_equal(got_pos, pos, err_msg=f"{case} step {s} head {g}")
            np.testing.assert_array_equal(seq.read_degrees(layer, g), deg)
            np.testing.assert_allclose(got_k, keys, atol=2e-6, rtol=0)
            np.testing.assert_allclose(got_v, values, atol=2e-6, rtol=0)
            outlier = (layer, g) in cfg.outlier_heads
            seen = sum(steps[: s + 1])
            assert got_pos.size == (seen if outlier else min(seen, got_pos.size))
            if not outlier:  # never more than budget + g - 1 held, and every original token counted once
                assert got_pos.size < cfg.budget + cfg.merge_interval + steps[s]
                assert deg.sum() == seen
        st, ps = seq.stats(), pool.stats()
        assert ps.kv_bytes == st.kv_bytes == st.blocks_held * pool.block_bytes
        assert st.blocks_held == sum(math.ceil(n / 32) for n in seq.head_tokens()[layer])
        compressions = lc.counters.get("compressions", 0)
    assert compressions >= 3  # the prompt, then every merge_interval decode steps


def test_merges_are_exact_for_duplicated_tokens(ov_core):
    """Chelsea's log(degree) makes a merge of identical tokens exact: the output equals full attention."""
    from ov_kvcrush.methods.vectors import layer_vectors

    lv = layer_vectors(4, kv_heads=HKV, q_heads=HQ, tokens=80, head_dim=D)
    k = lv.keys.repeat_interleave(2, dim=2)  # every token twice in a row: each A links to its twin B
    v = lv.values.repeat_interleave(2, dim=2)
    q = lv.queries.repeat_interleave(2, dim=2)
    cfg = method_config(
        "chelsea", budget=100, sink_tokens=0, recent_tokens=0, chunk_size=2, merge_interval=1, protect_tokens=0
    )
    pool = kvcache.KVPool(1, HQ, HKV, D, method=method_spec(cfg, 1, HQ, 32))
    seq = pool.new_sequence()
    full = kvcache.KVPool(1, HQ, HKV, D).new_sequence()

    req = op_model(ov_core, HQ, HKV, D)

    def feed(s, a, b):
        inputs = {"q": q[:, :, a:b].numpy(), "k": k[:, :, a:b].numpy(), "v": v[:, :, a:b].numpy()}
        return req.infer({**inputs, "kvc_sequence": [s.handle]})[0]

    feed(seq, 0, 120)
    feed(full, 0, 120)
    assert seq.head_tokens()[0].tolist() == [100] * HKV
    np.testing.assert_allclose(feed(seq, 120, 121), feed(full, 120, 121), atol=2e-5, rtol=0)


def test_refusals(ov_core):
    with pytest.raises(ConfigError, match="quant"):
        method_spec(method_config("chelsea", budget=96, quant=QuantSettings()), 4, HQ, 32)
    one_layer = method_spec(method_config("chelsea", budget=96, sink_tokens=4, recent_tokens=16), 1, HQ, 32)
    with pytest.raises(plugin.PluginError, match="budgets"):
        kvcache.KVPool(1, HQ, HKV, D, method=one_layer.replace("budgets=96", "budgets=20"))
    with pytest.raises(plugin.PluginError, match="outliers"):
        kvcache.KVPool(1, HQ, HKV, D, method=one_layer.replace("outliers=", "outliers=0,3"))
    cfg = method_config("chelsea", **BASE)
    seq = list(drive(ov_core, cfg, layer=1, steps=[200, 1]))[-1][3]
    with pytest.raises(plugin.PluginError, match="Chelsea"):
        seq.truncate(150)


def test_outlier_heads_name_global_layers_on_a_sliding_window_model(ov_core):
    """With local layers 0 and 2 (windows) and global layers 1 and 3, the pair (1, 2) names the
    second global layer, physical layer 3, as in the torch engine, which makes the reference's
    layer 1 of 2 for it: that head is held whole with the reference's positions, the same head
    of physical layer 1 is merged."""
    cfg = method_config("chelsea", **BASE, outlier_heads=((1, 2),))
    windows = [64, 0, 64, 0]
    spec = method_spec(cfg, 4, HQ, 32, windows=windows)
    pool = kvcache.KVPool(4, HQ, HKV, D, block_size=32, precision="f32", method=spec, windows=windows)
    seq = pool.new_sequence()
    lv = layer_vectors(0, kv_heads=HKV, q_heads=HQ, tokens=300, head_dim=D)
    q, k, v = (t[:, :, :300].numpy() for t in (lv.queries, lv.keys, lv.values))
    for layer in (1, 3):
        op_model(ov_core, HQ, HKV, D, layer=layer).infer(
            {"q": q, "k": k, "v": v, "kvc_sequence": np.array([seq.handle])}
        )
    lc = cfg.make_layer(1, 2)  # the torch engine's layer for physical layer 3
    lc.prefill(*(t[:, :, :300] for t in (lv.queries, lv.keys, lv.values)))
    held = seq.head_tokens()
    assert held[3, 2] == 300 and held[1, 2] < 300  # the outlier is global layer 1, not physical 1
    for g, (pos, deg, _, _) in enumerate(reference_heads(lc, HKV)):
        np.testing.assert_array_equal(seq.read_head(3, g)[0], pos)
        np.testing.assert_array_equal(seq.read_degrees(3, g), deg)
    seq.free()
    pool.close()
