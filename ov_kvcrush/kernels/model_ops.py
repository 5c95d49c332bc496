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
def _rotate_heads(
    x_base, o_base, sxh, sxd, soh, sod, HEADS, HALF, c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``x * cos + rotate_half(x) * sin`` for every head of one token, each product and the sum
    rounded to the output's dtype (as transformers rounds them)."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # every head of the token in one tile
    offs = tl.arange(0, BLOCK)[None, :]
    ok = (heads < HEADS) & (offs < HALF)
    x1 = tl.load(x_base + heads * sxh + offs * sxd, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + heads * sxh + (offs + HALF) * sxd, mask=ok, other=0.0).to(tl.float32)
    dt = o_base.dtype.element_ty
    a1 = (x1 * c1).to(dt).to(tl.float32)
    b1 = (-x2 * s1).to(dt).to(tl.float32)
    a2 = (x2 * c2).to(dt).to(tl.float32)
    b2 = (x1 * s2).to(dt).to(tl.float32)
    tl.store(o_base + heads * soh + offs * sod, (a1 + b1).to(dt), mask=ok)
    tl.store(o_base + heads * soh + (offs + HALF) * sod, (a2 + b2).to(dt), mask=ok)


@triton.jit
def _rotary(
    X, Y, COS, SIN, XO, YO,
    sxb, sxh, sxt, sxd, syb, syh, syt, syd, scb, sct, scd,
    sob, soh, sot, sod, spb, sph, spt, spd,
    T, HX, HY, HALF, BLOCK_HX: tl.constexpr, BLOCK_HY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    t = bt % T
    offs = tl.arange(0, BLOCK)[None, :]
    half = offs < HALF
    c_base = COS + b * scb + t * sct
    s_base = SIN + b * scb + t * sct
    # the token's angles, loaded once for every head of both tensors
    c1 = tl.load(c_base + offs * scd, mask=half, other=0.0).to(tl.float32)
    c2 = tl.load(c_base + (offs + HALF) * scd, mask=half, other=0.0).to(tl.float32)
    s1 = tl.load(s_base + offs * scd, mask=half, other=0.0).to(tl.float32)
    s2 = tl.load(s_base + (offs + HALF) * scd, mask=half, other=0.0).to(tl.float32)
    _rotate_heads(
        X + b * sxb + t * sxt, XO + b * sob + t * sot, sxh, sxd, soh, sod, HX, HALF, c1, c2, s1, s2,
        BLOCK_H=BLOCK_HX, BLOCK=BLOCK,
    )  # fmt: skip
    if BLOCK_HY > 0:  # the second tensor (the keys beside the queries)
        _rotate_heads(
            Y + b * syb + t * syt, YO + b * spb + t * spt, syh, syd, sph, spd, HY, HALF, c1, c2, s1, s2,
            BLOCK_H=BLOCK_HY, BLOCK=BLOCK,
        )  # fmt: skip


def rotary_warps(heads: int, block: int) -> int:
    """Warps of a rotary program over ``heads`` head rows of ``block`` pairs: a power of two (as
    Triton requires) from 1 to 8, one per 512 elements (Llama-3-8B's 32 + 8 heads: 8)."""
    return min(8, triton.next_power_of_2(max(1, heads * block // 512)))


def rotary_pair(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x * cos + rotate_half(x) * sin`` for the queries ``q`` and the keys ``k`` (``[b, heads,
    t, d]``, any strides, their own head counts; ``k`` may be ``None``) with ``cos``, ``sin``
    ``[b, t, d]``, as transformers' ``apply_rotary_pos_emb``; one launch for both, one program
    per token with all its heads in one tile (its angles loaded once)."""
    b, hq, t, d = q.shape
    if cos.shape[0] == 1 and b > 1:  # one set of positions for every row (a batch's prompt)
        cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
    if d % 2 or cos.shape != (b, t, d) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"rotary: q {tuple(q.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if k is not None and (k.shape[0] != b or k.shape[2:] != q.shape[2:]):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} (one batch, tokens and head size)")
    dtype = torch.result_type(q, cos)
    q_out = torch.empty((b, hq, t, d), dtype=dtype, device=q.device)
    k_out = None if k is None else torch.empty((b, k.shape[1], t, d), dtype=dtype, device=q.device)
    hk = 0 if k is None else k.shape[1]
    y, y_out = (q, q_out) if k is None or k_out is None else (k, k_out)  # no second tensor: never read
    block_hx = triton.next_power_of_2(hq)
    block_hy = 0 if k is None else triton.next_power_of_2(hk)
    block = max(16, triton.next_power_of_2(d // 2))
    _rotary[(b * t,)](
        q, y, cos, sin, q_out, y_out, *q.stride(), *y.stride(), *cos.stride(), *q_out.stride(), *y_out.stride(),
        t, hq, hk, d // 2, BLOCK_HX=block_hx, BLOCK_HY=block_hy, BLOCK=block,
        num_warps=rotary_warps(block_hx + block_hy, block),
    )  # fmt: skip
    return q_out, k_out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One tensor's rotary embedding (:func:`rotary_pair` without keys)."""
    return rotary_pair(x, None, cos, sin)[0]


@triton.jit
def _silu_mul(GU, Out, WIDTH, BLOCK: tl.constexpr):
    # int64 places: a batch's prompt through the MLP passes 2^31 elements (8 x 32k x 14336 = 3.8e9)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < WIDTH
    g = tl.load(GU + row * 2 * WIDTH + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * WIDTH + WIDTH + offs, mask=ok, other=0.0).to(tl.float32)
    dt = Out.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # SiLU, rounded as torch rounds it
    tl.store(Out + row * WIDTH + offs, (act * u).to(dt), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the Llama MLP's gate) from one product of both projections:
    ``gate_up`` ``[..., 2 * I]`` (contiguous) holds the gate's ``I`` outputs, then the up's."""
    width = gate_up.shape[-1]
    if width % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} (contiguous, gate then up: an even width)")
    inner = width // 2
    rows = gate_up.numel() // width
    out = torch.empty((*gate_up.shape[:-1], inner), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul[(rows, triton.cdiv(inner, 1024))](gate_up, out, inner, BLOCK=1024)
    return out
