"""The methods inside the C++ op against their torch references, on the shared test vectors.

A one-op OpenVINO model (``ov_kvcrush::PagedAttention``) and the reference ``LayerCache`` of the
same method config take the same queries/keys/values (:func:`ov_kvcrush.methods.vectors.layer_vectors`):
a prompt, then single-token decode steps. After every step the tokens each KV head holds (their
positions, read back through the op's stats API) must be the reference's, the attention output
must match, the head must hold no more than its budget, and the pool's bytes must be its blocks'.
The selection functions are also compared alone, on identical scores (ties included).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch
from helpers import HKV, HQ, D, held_positions, op_model

from ov_kvcrush import plugin
from ov_kvcrush.method_spec import method_spec
from ov_kvcrush.methods import REGISTRY, QuantSettings, method_config, methods_for
from ov_kvcrush.methods.importance import keep_indices, pool_scores
from ov_kvcrush.methods.kvcrush import kvcrush_select, kvcrush_select_blocks
from ov_kvcrush.methods.vectors import layer_vectors


def reference_positions(lc) -> list[np.ndarray]:
    """Positions each KV head of a reference layer cache holds (ascending, padding dropped)."""
    p = lc.store.positions[0]
    return [np.sort(p[g][p[g] >= 0].numpy()) for g in range(p.shape[0])]


def run_both(core, cfg, *, layer=0, layers=1, prompt=192, decode=40, seed=0, block_size=32, precision="f32", keep=None):
    """Run the op and the reference step by step; yield (step, op positions, ref positions, op out, ref out, seq)."""
    lv = layer_vectors(seed, kv_heads=HKV, q_heads=HQ, tokens=prompt + decode, head_dim=D)
    spec = method_spec(cfg, layers, HQ, block_size)
    pool = plugin.KVPool(layers, HQ, HKV, D, block_size=block_size, precision=precision, method=spec)
    seq = pool.new_sequence()
    req = op_model(core, HQ, HKV, D, layer=layer)
    lc = cfg.make_layer(layer, layers)
    if keep is not None:
        keep["lc"] = lc
    steps = [(0, prompt)] + [(prompt + i, prompt + i + 1) for i in range(decode)]
    for s, (a, b) in enumerate(steps):
        q, k, v = lv.queries[:, :, a:b], lv.keys[:, :, a:b], lv.values[:, :, a:b]
        out = req.infer({"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kvc_sequence": np.array([seq.handle])})[0]
        ref = lc.prefill(q, k, v) if s == 0 else lc.decode(q, k, v)
        yield s, held_positions(seq, layer), reference_positions(lc), np.array(out), ref.numpy(), seq, pool


# one config per method (and the variants that change the op's code path), at small budgets so
# that eviction runs at the prompt and during decode
CASES = {
    "streamingllm": dict(budget=96),
    "h2o": dict(budget=96, sink_tokens=4, recent_tokens=16),
    "snapkv": dict(budget=96, sink_tokens=4, recent_tokens=16, window=16),
    "snapkv-avg": dict(method="snapkv", budget=96, sink_tokens=4, recent_tokens=16, pool="avg", pool_kernel=5),
    "pyramidkv": dict(budget=96, sink_tokens=4, recent_tokens=16, window=16),
    "kvcrush": dict(budget=96, sink_tokens=4, recent_tokens=16, representatives=24),
    "kvcrush-h2o-threshold-first": dict(
        method="kvcrush",
        budget=96,
        sink_tokens=4,
        recent_tokens=16,
        selection="h2o",
        signature="threshold",
        representative="first",
    ),
    "kvcrush-multi-tuple": dict(
        method="kvcrush", budget=96, sink_tokens=4, recent_tokens=16, anchor=("random", "mean", "alternating")
    ),
    "kvcrush-multi-nearest": dict(
        method="kvcrush", budget=96, sink_tokens=4, recent_tokens=16, anchor=("zeros", "ones"), multi_anchor="nearest"
    ),
    "minikv": dict(budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(residual_tokens=32)),
    "snapkv-quant": dict(
        method="snapkv", budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(residual_tokens=64)
    ),
    "kvcrush-quant": dict(
        method="kvcrush", budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(group_size=32)
    ),
    "kvcrush-blocks": dict(
        method="kvcrush", budget=128, sink_tokens=16, recent_tokens=32, representatives=32, block_size=16
    ),
}


def make(case: str):
    fields = dict(CASES[case])
    name = fields.pop("method", case)
    return method_config(name, **fields)


def scores_by_position(positions, scores) -> dict[int, float]:
    return {int(p): float(v) for p, v in zip(positions, scores, strict=True) if p >= 0}


def op_scores(seq, layer, shared: bool) -> list[dict[int, float]]:
    """Per KV head: position -> score the op holds (group-summed; KVCrush: summed over all heads)."""
    per_head = []
    for g in range(HKV):
        pos, _, _, sc = seq.read_head(layer, g)
        per_head.append(scores_by_position(pos, sc.sum(1)))
    if shared:
        total = {p: sum(h[p] for h in per_head) for p in per_head[0]}
        return [total] * HKV
    return per_head


def ref_scores(lc, shared: bool) -> list[dict[int, float]]:
    acc = lc.acc[0].reshape(HKV, HQ // HKV, -1).sum(1)  # [hk, n]
    pos = lc.store.positions[0]
    per_head = [scores_by_position(pos[g].tolist(), acc[g].tolist()) for g in range(HKV)]
    if shared:
        total = {p: sum(h[p] for h in per_head) for p in per_head[0]}
        return [total] * HKV
    return per_head


def assert_near_tie(got, want, op_sc, ref_sc, what):
    """The op and the reference kept different tokens: only allowed between scores equal within float noise."""
    only_op = sorted(set(got.tolist()) - set(want.tolist()))
    only_ref = sorted(set(want.tolist()) - set(got.tolist()))
    assert len(only_op) == len(only_ref), what
    a = sorted(op_sc[p] for p in only_op)
    b = sorted(ref_sc[p] for p in only_ref)
    scale = max(ref_sc.values())
    np.testing.assert_allclose(
        a, b, atol=2e-6 * scale, rtol=0, err_msg=f"{what}: not a near-tie {only_op} vs {only_ref}"
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer", [0, 3])
def test_op_keeps_the_reference_tokens(ov_core, case, layer):
    """Same tokens kept as the reference at every step, until a float near-tie splits them (then justified)."""
    cfg = make(case)
    layers = 4
    bs = getattr(cfg, "block_size", None) or 32
    budget = cfg.layer_budget(layer, layers)
    shared = cfg.name == "kvcrush"
    quant = getattr(cfg, "quant", None) is not None
    frozen = quant or cfg.name == "minikv"
    diverged, last, first_qblocks = False, None, 0
    decode_evictions_compared = 0
    lc_holder = {}
    for step, got, want, out, ref, seq, pool in run_both(
        ov_core, cfg, layer=layer, layers=layers, block_size=bs, keep=lc_holder
    ):
        held = seq.head_tokens()[layer]
        if not diverged:
            same = all(np.array_equal(got[g], want[g]) for g in range(HKV))
            if same:
                np.testing.assert_allclose(out, ref, atol=3e-5, rtol=0, err_msg=f"{case} step {step}")
                if last is not None and (held < last + 1).any():
                    decode_evictions_compared += 1
            else:
                diverged = True
                o, r = op_scores(seq, layer, shared), ref_scores(lc_holder["lc"], shared)
                for g in range(HKV):
                    if not np.array_equal(got[g], want[g]):
                        assert_near_tie(got[g], want[g], o[g], r[g], f"{case} step {step} head {g}")
        last = held
        # a frozen selection (MiniKV, any method over the 2-bit store) keeps every generated token
        cap = budget + (step if frozen else 0)
        for g in range(HKV):
            assert got[g].size <= cap, f"{case} step {step} head {g} holds {got[g].size} > {cap}"
        st = seq.stats()
        # 2-bit blocks are always full and the residual starts on a block edge; a decode step's
        # evictions leave fewer than a block of holes per head before it is compacted
        holes = seq.head_holes()
        assert (holes < bs).all() and (holes[:layer].sum() + holes[layer + 1 :].sum()) == 0
        assert st.blocks_held + st.qblocks_held == sum(math.ceil(n / bs) for n in held + holes[layer])
        ps = pool.stats()
        assert ps.kv_bytes == st.kv_bytes == st.blocks_held * pool.block_bytes + st.qblocks_held * ps.qblock_bytes
        if step == 0:
            first_qblocks = st.qblocks_held
    if not diverged and not frozen:
        assert decode_evictions_compared > 0  # the decode-time eviction was exercised and matched
    if quant:
        assert st.qblocks_held > first_qblocks  # decode tokens were flushed into the 2-bit store
        assert pool.stats().qblock_bytes * 4 <= pool.block_bytes  # f32 here: 2 bits + scales is < 1/4


def test_decode_evictions_wait_as_holes_until_a_block_gathers(ov_core):
    """A decode step's eviction leaves a hole (not held, attention skips it, the reference's output
    still matches: the test above), compaction comes once a block's worth has gathered, and
    truncating a head with holes keeps exactly the earlier tokens it held."""
    cfg = make("h2o")
    prompt, bs = 192, 32
    seen_holes, before = [], None
    for _step, got, want, _out, _ref, seq, _pool in run_both(ov_core, cfg, prompt=prompt, decode=45, block_size=bs):
        holes = seq.head_holes()[0]
        seen_holes.append(int(holes.max()))
        assert all(np.array_equal(got[g], want[g]) for g in range(HKV))
        before = got
    assert max(seen_holes) == bs - 1 and 0 in seen_holes[2:], seen_holes  # gathered, then compacted
    assert seen_holes[-1] > 0  # the run ends with holes pending
    cut = prompt + 20
    seq.truncate(cut)
    for g in range(HKV):
        np.testing.assert_array_equal(seq.read_head(0, g)[0], before[g][before[g] < cut])
    st = seq.stats()
    slots = seq.head_tokens() + seq.head_holes()
    assert st.blocks_held == sum(math.ceil(n / bs) for n in slots.flat)


def test_registry_methods_are_mapped_or_refused():
    """Every registry method either maps to an op spec or is refused by name (never silently full)."""
    from ov_kvcrush.errors import UserError

    for name in REGISTRY:
        cfg = method_config(name) if name == "full" else method_config(name, budget=256)
        if name in methods_for("openvino"):
            spec = method_spec(cfg, 4, HQ, 32)
            assert name == "full" or f"method={name}" in spec
        else:
            with pytest.raises(UserError, match=name):
                method_spec(cfg, 4, HQ, 32)


# --------------------------------------------------------------------------------------------
# the selection functions alone: identical scores in, identical indices out


def _p(a: np.ndarray, t):
    return a.ctypes.data_as(ctypes.POINTER(t))


@pytest.mark.parametrize("ties", [False, True])
def test_keep_indices_matches_reference(ties):
    lib = plugin.load()
    rng = np.random.default_rng(1)
    # budgets from far below n (a prompt's selection) to n - 1 .. n - 8 (a decode step's few drops)
    cases = [(300, 100, 8, 20), (64, 64, 4, 4), (1000, 33, 0, 1), (50, 10, 5, 5)]
    cases += [(1025, 1025 - d, 4, 32) for d in (1, 2, 3, 7, 8, 9)] + [(40, 39, 0, 0), (40, 0, 0, 0)]
    for n, budget, sinks, recent in cases:
        s = rng.integers(0, 5, n).astype(np.float32) if ties else rng.random(n, dtype=np.float32)
        out = np.zeros(n, dtype=np.int64)
        k = plugin._check(
            lib.ovkc_keep_indices(_p(s, ctypes.c_float), n, budget, sinks, recent, _p(out, ctypes.c_int64))
        )
        want = keep_indices(torch.from_numpy(s)[None, None], budget, sinks, recent)[0, 0].numpy()
        np.testing.assert_array_equal(out[:k], want)


@pytest.mark.parametrize(("kernel", "pool"), [(7, "max"), (5, "avg"), (1, "max")])
def test_pool_scores_matches_reference(kernel, pool):
    lib = plugin.load()
    s = np.random.default_rng(2).random(77, dtype=np.float32)
    want = pool_scores(torch.from_numpy(s)[None, None], kernel, pool)[0, 0].numpy()
    plugin._check(lib.ovkc_pool_scores(_p(s, ctypes.c_float), s.size, kernel, int(pool == "avg")))
    np.testing.assert_allclose(s, want, rtol=1e-6)


KV_CASES = [
    dict(),
    dict(signature="threshold"),
    dict(representative="first"),
    dict(anchor=("random", "mean")),
    dict(anchor=("ones", "zeros", "alternating"), multi_anchor="nearest"),
    dict(anchor="mean", seed=7),
]


@pytest.mark.parametrize("fields", KV_CASES)
@pytest.mark.parametrize("block", [0, 16])
@pytest.mark.parametrize("ties", [False, True])
def test_kvcrush_select_matches_reference(fields, block, ties):
    lib = plugin.load()
    rng = np.random.default_rng(3)
    n, budget, sinks, recent, reps = 300, 128, 16, 32, 32
    s = (rng.integers(0, 4, (HQ, n)) if ties else rng.random((HQ, n))).astype(np.float32)
    cfg = method_config(
        "kvcrush", budget=budget, sink_tokens=sinks, recent_tokens=recent, representatives=reps, **fields
    )
    spec = method_spec(cfg, 1, HQ, 32)
    out = np.zeros(n, dtype=np.int64)
    k = plugin._check(
        lib.ovkc_kvcrush_select(
            _p(s, ctypes.c_float), HQ, n, budget, sinks, recent, reps, block, spec.encode(), _p(out, ctypes.c_int64)
        )
    )
    kw = dict(
        signature=cfg.signature,
        anchors=cfg.anchors,
        multi_anchor=cfg.multi_anchor,
        seed=cfg.seed,
        representative=cfg.representative,
    )
    t = torch.from_numpy(s)[None]
    if block:
        want = kvcrush_select_blocks(t, block, budget, sinks, recent, reps, **kw)[0]
    else:
        want = kvcrush_select(t, budget, sinks, recent, reps, **kw)[0].keep
    np.testing.assert_array_equal(out[:k], want.numpy())


def test_bad_method_specs_name_the_field():
    for spec, field in [
        ("method=h2o", "budgets"),
        ("method=h2o;budgets=10,10", "budgets"),
        ("method=h2o;budgets=64;sinks=40;recent=40", "budgets"),
        ("method=nope;budgets=64", "method"),
        ("method=h2o;budgets=64;pool_kernel=4", "pool_kernel"),
        ("method=kvcrush;budgets=64;anchors=101", "anchors"),
        ("method=h2o;budgets=64;colour=red", "colour"),
    ]:
        with pytest.raises(plugin.PluginError, match=field):
            plugin.KVPool(1, HQ, HKV, D, method=spec)


def test_two_bit_store_holds_the_reference_codes(ov_core):
    """The op's 2-bit tokens dequantize to the reference Int2Store's values (same codes, scales, zeros)."""
    cfg = method_config("minikv", budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(residual_tokens=32))
    holder: dict = {}
    seq = list(run_both(ov_core, cfg, decode=20, keep=holder))[-1][5]
    k_ref, v_ref, p_ref = holder["lc"].store.dense()
    nq = holder["lc"].store.quantized_tokens
    assert nq > 0 and seq.stats().qblocks_held * 32 == nq * HKV
    for g in range(HKV):
        pos, keys, values, _ = seq.read_head(0, g)
        np.testing.assert_array_equal(pos, p_ref[0, g].numpy())
        # the quantized part: same codes and fp16 scale/zero, so equal up to fused multiply-add rounding
        np.testing.assert_allclose(keys[:nq], k_ref[0, g, :nq].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(values[:nq], v_ref[0, g, :nq].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(keys[nq:], k_ref[0, g, nq:].numpy())  # the full-precision residual
