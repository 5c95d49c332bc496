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
from helpers import (
    HKV,
    HQ,
    D,
    check_op_keeps_the_reference_tokens,
    drive,
    held_positions,
    op_scores,
    ref_scores,
    reference_positions,
    run_both,
)

from ov_kvcrush.methods import REGISTRY, QuantSettings, method_config, methods_for, methods_on
from ov_kvcrush.methods.kvcrush import kvcrush_select, kvcrush_select_blocks
from ov_kvcrush.methods.selection import keep_indices, pool_scores
from ov_kvcrush.op import kvcache, plugin
from ov_kvcrush.op.method_spec import method_spec

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
        method="kvcrush",
        budget=96,
        sink_tokens=4,
        recent_tokens=16,
        quant=QuantSettings(group_size=32, residual_tokens=32, prompt_tail=24),
    ),
    "snapkv-4bit": dict(
        method="snapkv", budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(bits=4, residual_tokens=32)
    ),
    "h2o-k2v4": dict(
        method="h2o",
        budget=96,
        sink_tokens=4,
        recent_tokens=16,
        quant=QuantSettings(key_bits=2, value_bits=4, residual_tokens=32, prompt_tail=0),
    ),
    "kvcrush-blocks-quant": dict(
        method="kvcrush",
        budget=128,
        sink_tokens=16,
        recent_tokens=32,
        representatives=32,
        block_size=32,
        quant=QuantSettings(residual_tokens=32, prompt_tail=40),
    ),
    "snapkv-blocks": dict(method="snapkv", budget=128, sink_tokens=16, recent_tokens=32, block_size=32),
    "h2o-blocks-quant": dict(
        method="h2o",
        budget=128,
        sink_tokens=4,
        recent_tokens=16,
        block_size=32,
        quant=QuantSettings(residual_tokens=32),
    ),
    "kvcrush-blocks": dict(
        method="kvcrush", budget=128, sink_tokens=16, recent_tokens=32, representatives=32, block_size=16
    ),
    "kvcrush-heads": dict(
        method="kvcrush",
        budget=96,
        sink_tokens=4,
        recent_tokens=16,
        representatives=24,
        anchor=("random", "mean"),
        scope="head",
    ),
    "kvcrush-heads-blocks-quant": dict(
        method="kvcrush",
        budget=128,
        sink_tokens=16,
        recent_tokens=32,
        representatives=32,
        block_size=16,
        scope="head",
        quant=QuantSettings(bits=4, residual_tokens=32, prompt_tail=40),
    ),
}


def make(case: str):
    fields = dict(CASES[case])
    name = fields.pop("method", case)
    return method_config(name, **fields)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer", [0, 3])
def test_op_keeps_the_reference_tokens(ov_core, case, layer):
    """Same tokens kept as the reference at every step, until a float near-tie splits them (then justified)."""
    check_op_keeps_the_reference_tokens(ov_core, make(case), layer, case)


@pytest.mark.parametrize(("method", "bits"), [("snapkv", 2), ("snapkv", 4), ("kvcrush", 4), ("minikv", 4)])
def test_chat_turns_over_the_quantized_store_keep_the_reference_tokens_and_scores(ov_core, method, bits):
    """Multi-token steps (chat turns) between decode steps, over the 2-/4-bit store: the output
    matches (a turn's own tokens may be flushed into 2-bit blocks before it attends: they are
    masked for its earlier queries), the held tokens are the reference's, and for an evicting
    selection the 2-bit tokens' scores too (a turn's are recomputed per 2-bit block), so the
    flushed chunks the op drops are the reference's (KVCrush: one ranking per layer). MiniKV
    keeps its prefill selection."""
    quant = QuantSettings(bits=bits, residual_tokens=32, prompt_tail=16)
    cfg = method_config(method, budget=96, sink_tokens=4, recent_tokens=16, quant=quant)
    steps = [200] + [1] * 12 + [70] + [1] * 20 + [45] + [1] * 30
    layer, evicted, fed = 0, [], 0
    for s, out, ref, seq, _pool, lc in drive(ov_core, cfg, layer=layer, steps=steps, layers=1):
        fed += steps[s]
        got, want = held_positions(seq, layer), reference_positions(lc)
        for g in range(HKV):
            # the op reads its 2-bit tokens first: a turn flushed past the pinned tail comes before it
            np.testing.assert_array_equal(np.sort(got[g]), want[g], err_msg=f"step {s} head {g}")
        np.testing.assert_allclose(out, ref, atol=3e-5, rtol=0, err_msg=f"step {s}")
        if method == "minikv":
            assert seq.head_tokens()[layer].max() == 96 + fed - steps[0]
            continue
        o, r = op_scores(seq, layer, False), ref_scores(lc, False)
        for g in range(HKV):
            pos = sorted(r[g])
            np.testing.assert_allclose(
                [o[g][p] for p in pos], [r[g][p] for p in pos], rtol=2e-4, atol=1e-6, err_msg=f"step {s} head {g}"
            )
        evicted.append(lc.counters.get("evicted", 0))
        # within a chunk (and the recent window) of the budget, once a turn's own tokens are flushed
        assert seq.head_tokens()[layer].max() <= 96 + 31 + 16 + (steps[s] if steps[s] > 1 else 0)
    assert method == "minikv" or evicted[-1] > evicted[0]  # decode steps dropped the reference's chunks


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
        k = plugin.check_result(
            lib.ovkc_keep_indices(_p(s, ctypes.c_float), n, budget, sinks, recent, _p(out, ctypes.c_int64))
        )
        want = keep_indices(torch.from_numpy(s)[None, None], budget, sinks, recent)[0, 0].numpy()
        np.testing.assert_array_equal(out[:k], want)


@pytest.mark.parametrize(("kernel", "pool"), [(7, "max"), (5, "avg"), (1, "max")])
def test_pool_scores_matches_reference(kernel, pool):
    lib = plugin.load()
    s = np.random.default_rng(2).random(77, dtype=np.float32)
    want = pool_scores(torch.from_numpy(s)[None, None], kernel, pool)[0, 0].numpy()
    plugin.check_result(lib.ovkc_pool_scores(_p(s, ctypes.c_float), s.size, kernel, int(pool == "avg")))
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
    k = plugin.check_result(
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


def _spec(**fields) -> str:
    return ";".join(f"{k}={v}" for k, v in fields.items() if v is not None)


H2O = dict(method="h2o", budgets="64", quant=0, sinks=4, recent=4, scoring="h2o", frozen=0, block_wise=0)
SNAP = dict(H2O, scoring="snapkv", window=8, pool_kernel=7, pool="max")
QUANT_FIELDS = dict(quant=1, group=16, residual=32, tail=0, key_bits=2, value_bits=2)


def test_bad_method_specs_name_the_field():
    """The op has no defaults: a missing, unknown, repeated or bad field is an error naming it."""
    kvcache.KVPool(1, HQ, HKV, D, method=_spec(**H2O)).close()  # the baseline is valid
    for spec, field in [
        (_spec(**dict(H2O, budgets=None)), "budgets"),
        (_spec(**dict(H2O, budgets="10,10")), "budgets"),
        (_spec(**dict(H2O, sinks=40, recent=40)), "budgets"),
        (_spec(**dict(H2O, method="nope")), "method"),
        (_spec(**dict(H2O, frozen=None)), "frozen"),
        (_spec(**dict(H2O, quant=None)), "quant"),
        (_spec(**dict(SNAP, pool_kernel=4)), "pool_kernel"),
        (_spec(**dict(SNAP, window=None)), "window"),
        (_spec(**dict(H2O, window=8)), "window"),  # h2o scoring reads no window: unread is an error
        (_spec(**dict(H2O, colour="red")), "colour"),
        (_spec(**H2O) + ";sinks=4", "sinks"),
        (_spec(**dict(H2O, method="minikv")), "frozen"),  # MiniKV's selection is frozen
        # and KVCrush's and Knorm's over the 2-bit store (H2O/SnapKV drop whole chunks there)
        (_spec(**dict(H2O, method="knorm", **QUANT_FIELDS)), "frozen"),
        (_spec(**dict(H2O, frozen=1, **dict(QUANT_FIELDS, key_bits=3))), "key_bits"),
        (_spec(method="full", budgets="0", quant=1, group=16), "residual"),
        ("", "method"),
    ]:
        with pytest.raises(plugin.PluginError, match=field):
            kvcache.KVPool(1, HQ, HKV, D, method=spec)
    bad_anchor = method_spec(method_config("kvcrush", budget=64, sink_tokens=4, recent_tokens=4), 1, HQ, 32)
    with pytest.raises(plugin.PluginError, match="anchors"):
        kvcache.KVPool(1, HQ, HKV, D, method=bad_anchor.replace("anchors=", "anchors=101"))


def test_the_op_runs_exactly_the_methods_that_declare_it():
    """The op's policy table (``OVKC_REGISTER_POLICY``) and the declarations agree: a method declares
    the ``cpu-op`` runtime iff the op has its policy."""
    assert kvcache.policy_names() == sorted(methods_on("cpu-op")) == sorted(methods_for("openvino"))


@pytest.mark.parametrize("bits", [(2, 2), (4, 4), (2, 4)])
def test_quantized_store_holds_the_reference_codes(ov_core, bits):
    """The op's 2-/4-bit tokens dequantize to the reference QuantStore's values (same codes, scales, zeros)."""
    quant = QuantSettings(residual_tokens=32, key_bits=bits[0], value_bits=bits[1])
    cfg = method_config("minikv", budget=96, sink_tokens=4, recent_tokens=16, quant=quant)
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


def test_the_pool_default_is_the_full_cache_spec_python_writes():
    """KVPool's default method (kvcache.full_cache_spec, kept import-light) is method_spec's ``full``."""
    from ov_kvcrush.methods import FullConfig

    for layers in (1, 4):
        assert kvcache.full_cache_spec(layers) == method_spec(FullConfig(), layers, HQ, 32)
