"""The model's fused element-wise steps (RMSNorm, rotary embedding, SiLU gate) against
transformers' own modules, in Triton's interpreter; and a model running them generates
transformers' tokens."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.engines.fused_ops import fuse_model_ops, fused_forward
from ov_kvcrush.engines.hf_baseline import HFBaselineEngine
from ov_kvcrush.engines.torch_engine import TorchEngine
from ov_kvcrush.kernels import interpreting, triton_importable

pytestmark = pytest.mark.skipif(not (triton_importable() and interpreting()), reason="needs Triton's interpreter")

#: exact up to the order of a float32 sum: a rounding step of the dtype at most
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_rms_norm_is_transformers_rms_norm(dtype):
    from ov_kvcrush.kernels.model_ops import rms_norm

    gen = torch.Generator().manual_seed(1)
    norm = modeling_llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x = (3 * torch.randn(2, 5, 96, generator=gen)).to(dtype)
    with torch.no_grad():
        want = norm(x)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_rotary_is_transformers_rotary(dtype, rows):
    """Query and key views as the attention makes them (a projection viewed and transposed), one
    token per row (a decode step), and a prompt of four tokens whose positions every row shares."""
    from ov_kvcrush.kernels.model_ops import rotary

    gen = torch.Generator().manual_seed(rows)
    for t, cos_rows in ((1, rows), (4, 1)):
        q = torch.randn(rows, t, 6 * 16, generator=gen).to(dtype).view(rows, t, 6, 16).transpose(1, 2)
        k = torch.randn(rows, t, 2 * 16, generator=gen).to(dtype).view(rows, t, 2, 16).transpose(1, 2)
        angle = torch.randn(cos_rows, t, 16, generator=gen) * 3
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        for got, want in ((rotary(q, cos, sin), want_q), (rotary(k, cos, sin), want_k)):
            assert torch.allclose(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_silu_gate_is_the_mlp_gate(dtype):
    from ov_kvcrush.kernels.model_ops import silu_mul

    gen = torch.Generator().manual_seed(3)
    gate, up = (4 * torch.randn(2, 1, 300, generator=gen)).to(dtype), torch.randn(2, 1, 300, generator=gen).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    assert torch.allclose(silu_mul(gate, up).float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.slow
def test_a_fused_model_generates_transformers_tokens():
    """The torch engine with the fused steps (and its fast path) greedily generates what
    transformers generates on the same weights; transformers' own model, and calls outside the
    engine's forward passes, keep transformers' functions."""
    prompt = "The pass key is 52445. Remember it. " * 5 + "What is the pass key?"
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    sdpa = HFBaselineEngine("random:tiny-llama", backend="hf-sdpa")
    want = sdpa.generate(prompt, settings).token_ids
    engine = TorchEngine("random:tiny-llama", fast_path=True, fused_ops=True)
    layer = engine.model.model.layers[0]
    assert getattr(layer.input_layernorm, "ov_kvcrush_fused", False) and getattr(layer.mlp, "ov_kvcrush_fused", False)
    assert fuse_model_ops(engine.model) == 0  # once only
    assert not getattr(sdpa.model.model.layers[0].input_layernorm, "ov_kvcrush_fused", False)
    assert engine.generate(prompt, settings).token_ids == want
    assert sdpa.generate(prompt, settings).token_ids == want
    wrapped = modeling_llama.apply_rotary_pos_emb
    assert hasattr(wrapped, "ov_kvcrush_original")
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16)
    cos, sin = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    outside = wrapped(q, k, cos, sin)
    with fused_forward():
        inside = wrapped(q, k, cos, sin)
    original = wrapped.ov_kvcrush_original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(outside, original, strict=True))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(inside, original, strict=True))
