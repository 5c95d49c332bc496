"""The model's fused element-wise steps (RMSNorm, rotary embedding, SiLU gate) and packed
projections against transformers' own modules, in Triton's interpreter on CPU tensors (CI) or
compiled on a CUDA device; and a model running them generates transformers' tokens."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.engines.fused_ops import fuse_model_ops, fused_forward
from ov_kvcrush.engines.hf_baseline import HFBaselineEngine
from ov_kvcrush.engines.torch_engine import TorchEngine
from ov_kvcrush.kernels import interpreting, triton_importable

#: where the kernels run here: CPU tensors in Triton's interpreter, or a CUDA device
DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.skipif(
    not (triton_importable() and (interpreting() or torch.cuda.is_available())),
    reason="needs Triton's interpreter or a CUDA device",
)

#: exact up to the order of a float32 sum: a rounding step of the dtype at most
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_rms_norm_is_transformers_rms_norm(dtype):
    from ov_kvcrush.kernels.model_ops import rms_norm

    gen = torch.Generator().manual_seed(1)
    norm = modeling_llama.LlamaRMSNorm(96, eps=1e-5).to(DEVICE, dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(DEVICE, dtype)
    x = (3 * torch.randn(2, 5, 96, generator=gen)).to(DEVICE, dtype)
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
    from ov_kvcrush.kernels.model_ops import rotary, rotary_pair

    gen = torch.Generator().manual_seed(rows)
    for t, cos_rows in ((1, rows), (4, 1)):
        # the packed projection's parts, as the fused attention's modules return them
        qkv = torch.randn(rows, t, (6 + 2 + 2) * 16, generator=gen).to(DEVICE, dtype)
        q = qkv[..., : 6 * 16].view(rows, t, 6, 16).transpose(1, 2)
        k = qkv[..., 6 * 16 : 8 * 16].view(rows, t, 2, 16).transpose(1, 2)
        angle = torch.randn(cos_rows, t, 16, generator=gen) * 3
        cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
        want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        got_q, got_k = rotary_pair(q, k, cos, sin)
        for got, want in ((got_q, want_q), (got_k, want_k), (rotary(k, cos, sin), want_k)):
            assert got.shape == want.shape
            assert torch.allclose(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_silu_gate_is_the_mlp_gate(dtype):
    """From one product of the packed gate and up projections (gate's outputs, then up's)."""
    from ov_kvcrush.kernels.model_ops import silu_mul

    gen = torch.Generator().manual_seed(3)
    gate, up = (4 * torch.randn(2, 3, 1100, generator=gen)).to(dtype), torch.randn(2, 3, 1100, generator=gen).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(torch.cat([gate, up], dim=-1).to(DEVICE)).cpu()
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.slow
def test_a_fused_model_generates_transformers_tokens():
    """The torch engine with the fused steps (and its fast path; on CUDA its graphs) greedily
    generates what transformers generates on the same weights; transformers' own model, and
    calls outside the engine's forward passes, keep transformers' functions."""
    prompt = "The pass key is 52445. Remember it. " * 5 + "What is the pass key?"
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    sdpa = HFBaselineEngine("random:tiny-llama", backend="hf-sdpa", device=DEVICE, dtype="float32")
    want = sdpa.generate(prompt, settings).token_ids
    engine = TorchEngine("random:tiny-llama", device=DEVICE, dtype="float32", fast_path=True, fused_ops=True)
    layer = engine.model.model.layers[0]
    assert getattr(layer.input_layernorm, "ov_kvcrush_fused", False) and getattr(layer.mlp, "ov_kvcrush_fused", False)
    assert fuse_model_ops(engine.model) == 0  # once only
    assert not getattr(sdpa.model.model.layers[0].input_layernorm, "ov_kvcrush_fused", False)
    assert engine.generate(prompt, settings).token_ids == want
    assert sdpa.generate(prompt, settings).token_ids == want
    wrapped = modeling_llama.apply_rotary_pos_emb
    assert hasattr(wrapped, "ov_kvcrush_original")
    q, k = torch.randn(1, 4, 1, 16, device=DEVICE), torch.randn(1, 2, 1, 16, device=DEVICE)
    cos, sin = torch.randn(1, 1, 16, device=DEVICE), torch.randn(1, 1, 16, device=DEVICE)
    outside = wrapped(q, k, cos, sin)
    with fused_forward():
        inside = wrapped(q, k, cos, sin)
    original = wrapped.ov_kvcrush_original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(outside, original, strict=True))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(inside, original, strict=True))


def test_packed_projections_are_each_modules_own_product():
    """The attention's query, key and value projections (and the MLP's gate and up) packed into
    one weight each: every module's weight a view of it (no memory added), the query's call
    computing all three, the key and value returning their part on the same input and their own
    product on another; the whole layer's output unchanged."""
    config = modeling_llama.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        vocab_size=32, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = modeling_llama.LlamaForCausalLM(config).to(DEVICE).eval()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    own = {name: (lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone())
           for name, lin in [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("gate", mlp.gate_proj),
                             ("up", mlp.up_proj)]}  # fmt: skip
    ids = torch.randint(0, 32, (2, 7), device=DEVICE)
    with torch.no_grad():
        want = model(ids).logits
    params = sum(p.numel() for p in model.parameters())
    assert fuse_model_ops(model) > 0
    assert sum(p.numel() for p in model.parameters()) == params
    packed = attn.q_proj.ov_kvcrush_packed.weight
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert lin.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    x, y = torch.randn(2, 3, 64, device=DEVICE), torch.randn(2, 3, 64, device=DEVICE)
    with torch.no_grad():
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.k_proj(y), attn.v_proj(y)]
        inputs = [("q", x), ("k", x), ("v", x), ("k", y), ("v", y)]
        for out, (name, inp) in zip(got, inputs, strict=True):
            assert torch.allclose(out, torch.nn.functional.linear(inp, *own[name]), atol=1e-5), name
        assert torch.allclose(model(ids).logits, want, atol=1e-5)  # transformers' own rotary outside fused_forward
        with fused_forward():
            assert torch.allclose(model(ids).logits, want, atol=1e-5)


@pytest.mark.parametrize(("heads", "d"), [(1, 16), (6, 16), (40, 128), (64 + 8, 128), (128, 256)])
def test_rotary_warps_are_a_power_of_two(heads, d):
    """Triton refuses other warp counts, and the interpreter never checks them (Llama-3-8B's 32 + 8
    heads once asked for 5 on a GPU)."""
    from ov_kvcrush.kernels.model_ops import rotary_warps

    warps = rotary_warps(heads, d // 2)
    assert 1 <= warps <= 8 and warps & (warps - 1) == 0
