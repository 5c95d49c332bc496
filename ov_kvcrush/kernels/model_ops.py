"""A decoder layer's element-wise steps fused, one launch each (Triton): RMSNorm, the rotary
embedding, the SiLU gate.

A decode step of one token is launch-bound outside its matrix products: transformers' Llama
layer runs RMSNorm as eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), the
rotary embedding as six per tensor (multiply, two slices, negate, concatenate, multiply-add) and
the MLP's gate as two, about 45 kernels a layer in all. On an H200 a Llama-3-8B step's
element-wise kernels took 2.6 ms of its 8.1 (``docs/results/bench/``, the ClusterKV profile at
32k), a fixed cost every method pays whatever its cache reads. Each kernel here does one of these
steps in one launch, rounding where transformers rounds (every product and sum of the model's
dtype rounded to it, RMSNorm's statistics in float32), so the outputs are transformers' up to
the order of a float32 sum (tested in Triton's interpreter).

:mod:`ov_kvcrush.engines.fused_ops` puts them in a loaded model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, W, Out, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # a long prompt's rows x width pass 2^31
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(X + row * H + offs, mask=ok, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    w = tl.load(W + offs, mask=ok, other=0.0)
    y = (x * inv).to(Out.dtype.element_ty).to(tl.float32)  # transformers casts before the scale
    tl.store(Out + row * H + offs, (w.to(tl.float32) * y).to(Out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension (statistics in
    float32), as transformers' ``LlamaRMSNorm``; one program per row."""
    h = x.shape[-1]
    rows = x.numel() // h
    flat = x.reshape(rows, h)  # a view where x is contiguous (it always is: a projection's or a sum's output)
    out = torch.empty((rows, h), dtype=torch.result_type(weight, x), device=x.device)
    block = triton.next_power_of_2(h)
    _rms_norm[(rows,)](flat, weight, out, h, eps, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


@triton.jit
def _rotary(
    X, COS, SIN, Out,
    sxb, sxh, sxt, sxd, scb, sct, scd, sob, soh, sot, sod,
    T, HEADS, HALF, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    t = bt % T
    heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # every head of the token in one tile
    offs = tl.arange(0, BLOCK)[None, :]
    ok = (heads < HEADS) & (offs < HALF)
    x_base = X + b * sxb + t * sxt + heads * sxh
    c_base = COS + b * scb + t * sct
    s_base = SIN + b * scb + t * sct
    x1 = tl.load(x_base + offs * sxd, mask=ok, other=0.0)
    x2 = tl.load(x_base + (offs + HALF) * sxd, mask=ok, other=0.0)
    c1 = tl.load(c_base + offs * scd, mask=offs < HALF, other=0.0)  # the token's angles, shared by its heads
    c2 = tl.load(c_base + (offs + HALF) * scd, mask=offs < HALF, other=0.0)
    s1 = tl.load(s_base + offs * scd, mask=offs < HALF, other=0.0)
    s2 = tl.load(s_base + (offs + HALF) * scd, mask=offs < HALF, other=0.0)
    dt = Out.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the model's dtype
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
    o_base = Out + b * sob + t * sot + heads * soh
    tl.store(o_base + offs * sod, (a1 + b1).to(dt), mask=ok)
    tl.store(o_base + (offs + HALF) * sod, (a2 + b2).to(dt), mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[b, heads, t, d]`` (any strides) and ``cos``,
    ``sin`` ``[b, t, d]``, as transformers' ``apply_rotary_pos_emb`` rotates one tensor; one
    program per token, all its heads in one tile (its angles loaded once)."""
    b, heads, t, d = x.shape
    if cos.shape[0] == 1 and b > 1:  # one set of positions for every row (a batch's prompt)
        cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
    if d % 2 or cos.shape != (b, t, d) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"rotary: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    out = torch.empty((b, heads, t, d), dtype=torch.result_type(x, cos), device=x.device)
    block_h, block = triton.next_power_of_2(heads), max(16, triton.next_power_of_2(d // 2))
    _rotary[(b * t,)](
        x, cos, sin, out, *x.stride(), *cos.stride(), *out.stride(), t, heads, d // 2,
        BLOCK_H=block_h, BLOCK=block, num_warps=min(8, max(1, block_h * block // 512)),
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul(G, U, Out, N, BLOCK: tl.constexpr):
    # int64 places: a batch's prompt through the MLP passes 2^31 elements (8 x 32k x 14336 = 3.8e9)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    dt = Out.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # SiLU, rounded as torch rounds it
    tl.store(Out + offs, (act * u).to(dt), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the Llama MLP's gate), both contiguous and of one shape."""
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)}, up {tuple(up.shape)} (contiguous, one shape)")
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024)
    return out
