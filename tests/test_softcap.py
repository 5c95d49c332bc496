"""Gemma 2's attention soft-capping (``cap * tanh(s / cap)`` of each scaled logit, before the
softmax), in the torch reference and in the op, prompt and decode, attention and scores.

The reference is held to transformers' own eager attention (the function Gemma 2 runs); the op
to the reference, for every method it runs, at a cap that bends the test vectors' logits (their
spread is about 8, their largest over 200). The model-level check (a Gemma 2 export against
transformers) is in ``test_model_families.py``, beside the other family checks.
"""

from __future__ import annotations

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
    infer,
    op_model,
    reference_layer,
    reference_positions,
)

from ov_kvcrush.methods import QuantSettings, method_config
from ov_kvcrush.methods.attention import attend, cap_logits
from ov_kvcrush.methods.kvzip import KVzipConfig
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache, plugin
from ov_kvcrush.op.method_spec import method_spec

CAP = 20.0


def _transformers_attention(q, k, v, scale, cap):
    """Gemma 2's eager attention in transformers (causal over the last ``q`` positions)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    t, n = q.shape[2], k.shape[2]
    mask = torch.full((t, n), float("-inf")).triu(n - t + 1)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[1] // k.shape[1], False
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=scale, softcap=cap)
    return out.transpose(1, 2)


@pytest.mark.parametrize("t", [1, 7, 40])
def test_the_reference_caps_as_transformers_gemma2_does(t):
    g = torch.Generator().manual_seed(t)
    q = torch.randn(1, 4, t, 32, generator=g) * 3
    k, v = torch.randn(1, 2, 40, 32, generator=g) * 3, torch.randn(1, 2, 40, 32, generator=g)
    pos = dict(q_positions=torch.arange(40 - t, 40), k_positions=torch.arange(40))
    want = _transformers_attention(q, k, v, 0.2, 1.5)
    got = attend(q, k, v, scale=0.2, softcap=1.5, **pos)
    with_scores = attend(q, k, v, scale=0.2, softcap=1.5, return_scores=True, **pos)
    torch.testing.assert_close(got.output, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(with_scores.output, want, atol=1e-6, rtol=0)
    uncapped = attend(q, k, v, scale=0.2, **pos).output
    assert (uncapped - want).abs().max() > 0.1  # the cap changes this attention


def test_cap_logits_bounds_and_keeps_small_logits():
    s = torch.tensor([-1e4, -30.0, -1e-3, 0.0, 1e-3, 30.0, 1e4])
    c = cap_logits(s, 10.0)
    assert c.abs().max() <= 10.0 and (c.diff() >= 0).all()  # bounded, order kept
    torch.testing.assert_close(c[2:5], s[2:5], atol=1e-9, rtol=1e-6)
    assert cap_logits(s, None) is s


@pytest.mark.parametrize("precision", ["f32", "f16"])
def test_the_op_caps_prompt_and_decode_attention_and_scores(ov_core, precision):
    """The full cache with scores kept (H2O's sums): each step's output and every slot's summed
    probability are the capped reference's; a store other than f32 rounds the earlier tokens a
    decode step reads, so the reference reads them rounded too."""
    v = layer_vectors(3, kv_heads=HKV, q_heads=HQ, tokens=120, head_dim=D)
    req = op_model(ov_core, HQ, HKV, D, softcap=CAP)
    pool = kvcache.KVPool(1, HQ, HKV, D, block_size=16, precision=precision, scores=True)
    seq = pool.new_sequence()
    stored = (lambda x: x) if precision == "f32" else (lambda x: x.half().float())
    keys, values, scores = [], [], torch.zeros(1, HQ, 0)
    for a, b in ((0, 100), (100, 101), (101, 102), (102, 120)):
        q, k, val = v.queries[:, :, a:b], v.keys[:, :, a:b], v.values[:, :, a:b]
        out = infer(req, {"q": q.numpy(), "k": k.numpy(), "v": val.numpy(), "kvc_sequence": np.array([seq.handle])})
        # a prompt or a turn attends its own tokens exactly and the earlier ones as stored; a
        # decode token reads the store
        own = (lambda x: x) if b - a > 1 else stored
        kk, vv = torch.cat([*map(stored, keys), own(k)], 2), torch.cat([*map(stored, values), own(val)], 2)
        pos = dict(q_positions=torch.arange(a, b), k_positions=torch.arange(b))
        ref = attend(q, kk, vv, softcap=CAP, return_scores=True, **pos)
        np.testing.assert_allclose(out[0], ref.output.numpy(), atol=5e-5, rtol=0, err_msg=f"step {a}")
        uncapped = attend(q, kk, vv, **pos).output
        assert (uncapped - ref.output).abs().max() > 1e-2  # the cap matters at this step
        keys, values = [*keys, k], [*values, val]
        scores = torch.nn.functional.pad(scores, (0, b - a)) + ref.scores
    for g in range(HKV):
        pos, _, _, sc = seq.read_head(0, g)
        want = scores[0, g * (HQ // HKV) : (g + 1) * (HQ // HKV)].T.numpy()
        np.testing.assert_allclose(sc, want, atol=5e-5, rtol=1e-4, err_msg=f"head {g}")


#: every op method's code path that computes logits: attention over the full-precision store,
#: the 2-bit store and recalled clusters; scores summed (H2O), windowed (SnapKV), merged (Chelsea)
EVICTION = {
    "streamingllm": dict(budget=96),
    "h2o": dict(budget=96, sink_tokens=4, recent_tokens=16),
    "snapkv": dict(budget=96, sink_tokens=4, recent_tokens=16, window=16),
    "pyramidkv": dict(budget=96, sink_tokens=4, recent_tokens=16, window=16),
    "kvcrush": dict(budget=96, sink_tokens=4, recent_tokens=16, representatives=24),
    "minikv": dict(budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(residual_tokens=32)),
    "snapkv-2bit": dict(budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(residual_tokens=64)),
    "knorm": dict(budget=96, sink_tokens=4, recent_tokens=16),
}


@pytest.mark.parametrize("case", list(EVICTION))
def test_the_op_keeps_the_capped_references_tokens(ov_core, case):
    cfg = method_config(case.split("-")[0], **EVICTION[case])
    check_op_keeps_the_reference_tokens(ov_core, cfg, 0, f"{case} capped", layers=1, softcap=CAP)


@pytest.mark.parametrize("method", ["clusterkv", "chelsea"])
def test_recall_and_merging_attend_as_the_capped_reference(ov_core, method):
    fields = {
        "clusterkv": dict(budget=96, sink_tokens=4, tokens_per_cluster=16, cluster_every=12, dense_layers=0),
        "chelsea": dict(budget=96, sink_tokens=4, recent_tokens=16, chunk_size=32, merge_interval=8),
    }[method]
    cfg = method_config(method, **fields)
    for s, out, ref, *_ in drive(ov_core, cfg, layer=1, steps=[200] + [1] * 20, softcap=CAP):
        np.testing.assert_allclose(out, ref, atol=5e-5, rtol=0, err_msg=f"{method} step {s}")


def test_a_kvzip_scoring_pass_keeps_the_capped_references_tokens(ov_core):
    prompt, layers = 192, 1
    cfg = KVzipConfig(budget=48, sink_tokens=4, recent_tokens=8)
    v = layer_vectors(7, kv_heads=HKV, q_heads=HQ, tokens=prompt + 40, head_dim=D)
    lc = reference_layer(cfg, 0, layers, CAP)
    pool = kvcache.KVPool(layers, HQ, HKV, D, precision="f32", method=method_spec(cfg, layers, HQ, 32))
    seq = pool.new_sequence()
    req = op_model(ov_core, HQ, HKV, D, softcap=CAP)

    def feed(s):
        q, k, val = (x[:, :, s] for x in (v.queries, v.keys, v.values))
        return infer(req, {"q": q.numpy(), "k": k.numpy(), "v": val.numpy(), "kvc_sequence": np.array([seq.handle])})[0]

    ref = lc.prefill(v.queries[:, :, :prompt], v.keys[:, :, :prompt], v.values[:, :, :prompt])
    np.testing.assert_allclose(feed(slice(0, prompt)), ref.numpy(), atol=5e-5)
    s = slice(prompt, prompt + 40)
    lc.score_step(v.queries[:, :, s], v.keys[:, :, s], v.values[:, :, s], (0, prompt))
    cfg.finish_scoring_pass([lc])
    seq.score_positions(0, prompt)
    feed(s)
    seq.end_scoring_pass()
    got, want = held_positions(seq, 0), reference_positions(lc)
    for g in range(HKV):
        np.testing.assert_array_equal(got[g], want[g], err_msg=f"head {g}")


def test_the_op_refuses_a_cap_that_is_not_positive_and_finite(ov_core):
    for cap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(Exception, match=r"softcap must be 0 \(none\) or a positive finite cap"):
            op_model(ov_core, HQ, HKV, D, softcap=cap)


def test_the_gpu_paths_refuse_a_cap_by_name():
    """The torch engine's Intel GPU device pool and the CUDA fast path take raw logits: each says
    so, never runs it (the openvino backend's device GPU caps: ``test_gpu_plugin_gemma.py``)."""
    from ov_kvcrush.fastpath.dense import FastLayerCache
    from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache

    assert "CUDA" in FastLayerCache.softcap_refusal and "Intel GPU" in DeviceFullLayerCache.softcap_refusal
    assert not method_config("snapkv", budget=96).make_layer(0, 1).softcap_refusal  # the reference caps


@pytest.mark.skipif("bf16" not in plugin.kernel_isa(), reason="no AVX512-BF16 on this machine")
def test_a_bf16_prompt_is_capped_within_bf16_rounding(ov_core, bf16_products):
    """compute=bf16 (a bf16 inference precision): the prompt's logits come from bf16 products,
    then the cap; within bf16's rounding of the capped reference, far from the uncapped one."""
    v = layer_vectors(5, kv_heads=HKV, q_heads=HQ, tokens=300, head_dim=D)
    req = op_model(ov_core, HQ, HKV, D, compute="bf16", softcap=CAP)
    seq = kvcache.KVPool(1, HQ, HKV, D, precision="f32").new_sequence()
    q, k, val = v.queries, v.keys, v.values
    out = infer(req, {"q": q.numpy(), "k": k.numpy(), "v": val.numpy(), "kvc_sequence": np.array([seq.handle])})[0]
    pos = dict(q_positions=torch.arange(300), k_positions=torch.arange(300))
    ref = attend(q, k, val, softcap=CAP, **pos).output.numpy()
    err = np.abs(out - ref).max()
    assert err < 2e-2 * np.abs(ref).max(), err
    assert np.abs(attend(q, k, val, **pos).output.numpy() - ref).max() > 10 * err
