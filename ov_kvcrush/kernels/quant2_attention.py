"""Decode attention that reads MiniKV's bit-packed 2- or 4-bit store directly (Triton).

The reference dequantises the whole store into full-precision tensors every step and attends
those (:meth:`~ov_kvcrush.methods.store.Int2Store.dense`): four times the store's bytes written and
read again, per layer and token. This kernel unpacks and dequantises inside the attention, so a
step reads the 2-bit codes and their fp16 scales once (MiniKV, arXiv 2411.18077, seed 003: its
decode kernels do the same; the format is KIVI's, arXiv 2402.02750):

* keys: codes packed ``P = 32 / bits`` per int32 along tokens (word ``i // P`` of a channel holds
  token ``i`` at bits ``bits * (i % P)``), one fp16 scale and zero per channel per ``G`` tokens;
* values: codes packed ``P`` per int32 along channels, one scale and zero per token per ``G``
  channels; keys and values may have different widths (``KBITS``, ``VBITS``);
* then the newest tokens in full precision (the residual), ``residual_len`` of them: read from a
  device tensor, so a CUDA graph replays the kernel with the live count.

One program per query head; an online softmax over the quantised tokens then the residual. The
token count of the quantised part is a launch argument (it changes only when the residual is
flushed, outside any graph).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _quant2_decode(
    Q, QK, KS, KZ, QV, VS, VZ, RK, RV, RLEN, Out,
    sqb, sqh, sqd,
    skb, skh, skw, skd, sksb, sksh, sksg, sksd,
    svb, svh, svn, svw, svsb, svsh, svsn, svsg,
    srb, srh, srn, srd, sob, soh, sod,
    HQ, GROUP, NQ, R, D, G, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_d * sqd, mask=dmask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.zeros([BLOCK_N], dtype=tl.float32), 0) - float("inf")
    l_i = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    # the quantised tokens
    for start in range(0, NQ, BLOCK_N):
        offs_n = start + offs_n0
        nmask = offs_n < NQ
        m2 = nmask[:, None] & dmask[None, :]
        kper = 32 // KBITS
        kw = tl.load(
            QK + b * skb + hk * skh + (offs_n // kper)[:, None] * skw + offs_d[None, :] * skd, mask=m2, other=0
        )
        kc = (kw >> (KBITS * (offs_n % kper))[:, None]) & ((1 << KBITS) - 1)
        kidx = b * sksb + hk * sksh + (offs_n // G)[:, None] * sksg + offs_d[None, :] * sksd
        ks = tl.load(KS + kidx, mask=m2, other=0.0).to(tl.float32)
        kz = tl.load(KZ + kidx, mask=m2, other=0.0).to(tl.float32)
        k = kz + kc.to(tl.float32) * ks
        s = tl.where(nmask, tl.sum(q[None, :] * k, 1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        vper = 32 // VBITS
        vw = tl.load(
            QV + b * svb + hk * svh + offs_n[:, None] * svn + (offs_d // vper)[None, :] * svw, mask=m2, other=0
        )
        vc = (vw >> (VBITS * (offs_d % vper))[None, :]) & ((1 << VBITS) - 1)
        vidx = b * svsb + hk * svsh + offs_n[:, None] * svsn + (offs_d // G)[None, :] * svsg
        vs = tl.load(VS + vidx, mask=m2, other=0.0).to(tl.float32)
        vz = tl.load(VZ + vidx, mask=m2, other=0.0).to(tl.float32)
        v = vz + vc.to(tl.float32) * vs
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    # the full-precision residual
    r_len = tl.load(RLEN)
    for start in range(0, R, BLOCK_N):
        offs_n = start + offs_n0
        nmask = offs_n < r_len
        m2 = nmask[:, None] & dmask[None, :]
        ridx = b * srb + hk * srh + offs_n[:, None] * srn + offs_d[None, :] * srd
        k = tl.load(RK + ridx, mask=m2, other=0.0).to(tl.float32)
        s = tl.where(nmask, tl.sum(q[None, :] * k, 1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(RV + ridx, mask=m2, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(Out + b * sob + h * soh + offs_d * sod, (acc / l_i).to(Out.dtype.element_ty), mask=dmask)


def quant2_decode_attention(
    queries: torch.Tensor,
    packed: tuple[torch.Tensor, ...],
    quantized_tokens: int,
    group_size: int,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_len: torch.Tensor,
    scale: float | None = None,
    key_bits: int = 2,
    value_bits: int = 2,
) -> torch.Tensor:
    """Attention of one query token per head over a 2-bit store and its residual.

    Args:
        queries: ``[b, hq, 1, d]``.
        packed: ``(qk, k_scale, k_zero, qv, v_scale, v_zero)`` in
            :class:`~ov_kvcrush.methods.store.Int2Store`'s layout, holding at least
            ``quantized_tokens`` tokens (a larger, preallocated store is read up to there).
        quantized_tokens: tokens of the quantised part attended (a multiple of 16).
        group_size: ``G`` of the scales and zeros.
        residual_keys, residual_values: ``[b, hk, R, d]``, the first ``residual_len`` held.
        residual_len: ``[1]`` integer tensor on the device.
        scale: logit scale, ``1/sqrt(d)`` by default.
        key_bits, value_bits: the codes' widths (2 or 4).

    Returns ``[b, hq, 1, d]`` in the query dtype; the same as the reference attention over the
    dequantised store (tested against it).
    """
    qk, ks, kz, qv, vs, vz = packed
    b, hq, t, d = queries.shape
    hk = residual_keys.shape[1]
    if t != 1 or hq % hk or quantized_tokens % 16 or d % 16 or group_size % 16 or {key_bits, value_bits} - {2, 4}:
        raise ValueError(
            f"quant2_decode_attention: queries {tuple(queries.shape)}, kv heads {hk}, quantized_tokens "
            f"{quantized_tokens}, group_size {group_size}, bits {key_bits}/{value_bits} "
            "(one query token; multiples of 16; 2 or 4 bits)"
        )
    if kz.stride() != ks.stride() or vz.stride() != vs.stride() or residual_values.stride() != residual_keys.stride():
        raise ValueError("quant2_decode_attention: scales and zeros (and residual keys and values) need one layout")
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * 1.4426950408889634
    out = torch.empty_like(queries)
    block_d = max(16, triton.next_power_of_2(d))
    _quant2_decode[(b * hq,)](
        queries, qk, ks, kz, qv, vs, vz, residual_keys, residual_values, residual_len, out,
        queries.stride(0), queries.stride(1), queries.stride(3),
        *qk.stride(), *ks.stride(),
        *qv.stride(), *vs.stride(),
        *residual_keys.stride(), out.stride(0), out.stride(1), out.stride(3),
        hq, hq // hk, quantized_tokens, residual_keys.shape[2], d, group_size, qk_scale,
        BLOCK_N=64 if queries.device.type == "cuda" else 32, BLOCK_D=block_d, KBITS=key_bits, VBITS=value_bits,
    )  # fmt: skip
    return out
