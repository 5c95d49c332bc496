"""The op's bf16 prefill on AMX tiles (kernels_amx.cpp) against the f32 reference attention.

Where the build and the process have AMX, ``compute="bf16"`` prefill runs on tiles (16 query
rows against 64 staged tokens per step): outputs and per-head scores (from the kernel's
log-sum-exp) must match the reference attention (``helpers.causal_reference``) within bf16 rounding, for
head sizes the tiles take, prompts that are not whole tiles, and chunks after a cached prefix.
Elsewhere the test is skipped (the AVX512-BF16 kernel is tested in test_plugin.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import causal_reference, op_model

from ov_kvcrush.op import kvcache, plugin

pytestmark = pytest.mark.skipif("amx" not in plugin.kernel_isa(), reason="no AMX tiles on this machine")

CASES = [
    # (hq, hkv, d, steps): prompts of odd lengths, a chunk after a cached prefix, decode between
    (9, 3, 64, [100, 1, 37, 1]),
    (8, 2, 128, [70, 33]),
    (4, 4, 32, [17, 200]),
    (6, 1, 64, [129, 1]),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "steps"), CASES)
def test_amx_prefill_matches_the_reference_within_bf16(ov_core, hq, hkv, d, steps):
    rng = np.random.default_rng(d + len(steps))
    req = op_model(ov_core, hq, hkv, d, compute="bf16")
    pool = kvcache.KVPool(1, hq, hkv, d, precision="f32", scores=True)
    seq = pool.new_sequence()
    ks, vs, want_scores = [], [], None
    for n in steps:
        q = rng.standard_normal((1, hq, n, d), dtype=np.float32)
        k = rng.standard_normal((1, hkv, n, d), dtype=np.float32)
        v = rng.standard_normal((1, hkv, n, d), dtype=np.float32)
        out = np.array(req.infer({"q": q, "k": k, "v": v, "kvc_sequence": np.array([seq.handle])})[0])
        ks.append(k)
        vs.append(v)
        ref, scores = causal_reference(q, np.concatenate(ks, 2), np.concatenate(vs, 2))
        tol = 2e-5 if n == 1 else 2e-2  # decode is f32; bf16 keeps 8 mantissa bits
        assert np.abs(out - ref).max() < tol * max(1.0, np.abs(ref).max())
        step_scores = scores[0]  # [hq, total]: this step's probabilities per key
        if want_scores is None:
            want_scores = step_scores
        else:
            want_scores = np.concatenate([want_scores, np.zeros((hq, n))], axis=1) + step_scores
    group = hq // hkv
    for g in range(hkv):
        _pos, _k, _v, sc = seq.read_head(0, g)
        np.testing.assert_allclose(sc.T, want_scores[g * group : (g + 1) * group], atol=2e-2, rtol=2e-2)
    pool.close()


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "prompt", "step", "lo", "hi"), [(9, 3, 64, 300, 37, 21, 250), (8, 2, 128, 140, 70, 0, 140)]
)
def test_amx_scoring_step_keeps_the_reference_maxima_within_bf16(ov_core, hq, hkv, d, prompt, step, lo, hi):
    """KVzip's scoring step on tiles (kernels_amx.cpp: score_step_amx): each held slot of the
    scored range keeps the largest probability the step's queries give it, as the reference's
    ``score_step`` computes it in f32; slots outside the range stay unscored."""
    import torch

    from ov_kvcrush.methods import KVzipConfig
    from ov_kvcrush.op.method_spec import method_spec

    rng = np.random.default_rng(d + step)
    q, k, v = (rng.standard_normal((1, h, prompt + step, d), dtype=np.float32) for h in (hq, hkv, hkv))
    cfg = KVzipConfig(budget=32, sink_tokens=4)
    lc = cfg.make_layer(0, 1)
    lc.prefill(*(torch.from_numpy(x[:, :, :prompt]) for x in (q, k, v)))
    lc.score_step(*(torch.from_numpy(x[:, :, prompt:]) for x in (q, k, v)), (lo, hi))
    want = lc.score[0].numpy()  # [hkv, prompt]

    req = op_model(ov_core, hq, hkv, d, compute="bf16")
    pool = kvcache.KVPool(1, hq, hkv, d, precision="f32", method=method_spec(cfg, 1, hq, 32))
    seq = pool.new_sequence()

    def feed(a, b):
        return req.infer(
            {"q": q[:, :, a:b], "k": k[:, :, a:b], "v": v[:, :, a:b], "kvc_sequence": np.array([seq.handle])}
        )

    feed(0, prompt)
    seq.score_positions(lo, hi)
    feed(prompt, prompt + step)
    for g in range(hkv):
        pos, _k, _v, sc = seq.read_head(0, g)
        got = sc.max(1)  # the selection ranks a slot by its group's largest
        inside = (pos >= lo) & (pos < hi)
        np.testing.assert_allclose(got[inside], want[g][pos[inside]], atol=1e-3, rtol=3e-2)
        assert (got[~inside] == 0).all()
    seq.end_scoring_pass(select=False)
    pool.close()
