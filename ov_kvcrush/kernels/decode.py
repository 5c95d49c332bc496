"""One decode step's attention over a preallocated store, split over the keys (Triton).

A decode step has one query token: per KV head, its group of query heads against every key the
head attends. Torch's fused attention with a mask parallelises over (batch, heads, query tiles)
only, so a Llama-3-8B layer (8 KV heads) runs 8 thread blocks on a 132-multiprocessor H100: at
32k tokens the step's attention took 20 ms (measured) where reading the 4 GiB cache takes 1.4 ms.
Here the keys are split into chunks (flash-decoding): each program attends one chunk for one KV
head's whole query group (the keys are read once per KV head), writing a partial output with its
running max and sum; a second kernel merges the chunks. Two launches, no host sync, static
shapes: a CUDA graph captures it.

What is attended is given in place, so nothing is gathered or copied first:

* ``length`` (``[1]`` int64 on the device): the first ``length`` slots of the store are held (the
  rest of its capacity is unwritten) -- the full cache;
* ``slots`` (``[b, hk, L]`` int64): per KV head, the store slots to attend, ``-1`` for none --
  the recalled clusters of ClusterKV, the pages of Quest. Slots at or past ``length`` are masked
  too (a window's slots not written yet).

The reference (:func:`ov_kvcrush.methods.attention.attend` over the gathered keys) is what this
is tested against (``tests/test_kernels.py``, in Triton's interpreter on CPU tensors).
Runs on Triton 3.6 (the GPU image) and 3.9 (CI).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ov_kvcrush.kernels import LOG2E, dot_precision

#: programs to aim for per launch (about two per multiprocessor of an H100)
TARGET_PROGRAMS = 264
#: keys per chunk at least (a chunk below this costs more in merging than it saves). On an H200
#: (``docs/results/bench/kernels_cuda_issue74_after_h200.json``) ClusterKV's ~1.3k slots of one sequence
#: attended in 9.6 us a layer with 64 (21 programs a KV head) against 13.6 with 256; a batch of
#: eight (5 programs a KV head either way) is unchanged
MIN_CHUNK = 64


@triton.jit
def _decode_partial(
    Q, K, V, SLOTS, LEN, PO, PM, PL,
    sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, ssb, ssh, ssn,
    HK, GROUP, L, D, qk_scale, CHUNK, SPLITS,
    HAS_SLOTS: tl.constexpr, HAS_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // HK
    hk = bh % HK
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < D
    q = tl.load(
        Q + b * sqb + (hk * GROUP + offs_g)[:, None] * sqh + offs_d[None, :] * sqd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    lo = sp * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    if HAS_LEN:
        n_valid = tl.load(LEN)
        if not HAS_SLOTS:  # a prefix of the store: skip the unwritten chunks' work
            hi = tl.minimum(hi, n_valid)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(lo, hi, BLOCK_N):
        idx = start + offs_n0
        valid = idx < hi
        if HAS_SLOTS:
            slot = tl.load(SLOTS + b * ssb + hk * ssh + idx * ssn, mask=valid, other=-1)
            valid = valid & (slot >= 0)
            if HAS_LEN:
                valid = valid & (slot < n_valid)
            slot = tl.where(valid, slot, 0)
        else:
            slot = idx
        kt = tl.load(
            k_base + slot[None, :] * skn + offs_d[:, None] * skd,
            mask=valid[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep every term 0, not nan
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slot[:, None] * svn + offs_d[None, :] * svd,
            mask=valid[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    row = (bh * SPLITS + sp) * GROUP + offs_g
    tl.store(PO + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(PM + row, m_i, mask=g_ok)
    tl.store(PL + row, l_i, mask=g_ok)


@triton.jit
def _decode_merge(
    PO, PM, PL, Out,
    sob, soh, sod,
    HK, GROUP, D, SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // HK
    hk = bh % HK
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < SPLITS
    row = (bh * SPLITS + offs_s) * GROUP + g
    m = tl.load(PM + row, mask=s_ok, other=float("-inf"))
    l_part = tl.load(PL + row, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
    acc = tl.load(PO + row[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_part * w, 0)
    tl.store(Out + b * sob + (hk * GROUP + g) * soh + offs_d * sod, out.to(Out.dtype.element_ty), mask=offs_d < D)


def plan_splits(rows: int, keys: int) -> tuple[int, int]:
    """``(chunk, splits)``: keys per program and programs per KV head for ``rows`` KV heads
    attending ``keys`` slots (enough programs to fill the GPU, chunks of at least MIN_CHUNK)."""
    splits = max(1, min(triton.cdiv(keys, MIN_CHUNK), triton.cdiv(TARGET_PROGRAMS, max(rows, 1))))
    chunk = triton.cdiv(triton.cdiv(keys, splits), 64) * 64
    return chunk, triton.cdiv(keys, chunk)


def decode_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    *,
    length: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token's attention over a store, in place (see the module doc).

    Args:
        queries: ``[b, hq, 1, d]``; ``hq`` a multiple of ``hk``.
        keys, values: the store, ``[b, hk, S, d]``, any strides.
        scale: logit scale, ``1/sqrt(d)`` by default.
        length: ``[1]`` int64 on the device: slots at or past it are not attended.
        slots: ``[b, hk, L]`` int64: per KV head, the store slots attended (``-1``: none);
            ``None``: slots ``0 .. S-1``.

    Returns ``[b, hq, 1, d]`` in the query dtype. Every KV head must attend at least one key.
    """
    b, hq, t, d = queries.shape
    hk, cap = keys.shape[1], keys.shape[2]
    if t != 1 or hq % hk or keys.shape[3] != d or values.shape != keys.shape:
        raise ValueError(f"decode_attention: queries {tuple(queries.shape)}, keys {tuple(keys.shape)}")
    if slots is not None and (slots.shape[:2] != (b, hk) or slots.dim() != 3):
        raise ValueError(f"decode_attention: slots {tuple(slots.shape)} for keys {tuple(keys.shape)}")
    group = hq // hk
    n = cap if slots is None else slots.shape[2]
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    block_d = max(16, triton.next_power_of_2(d))
    block_g = max(16, triton.next_power_of_2(group))
    block_n = 64 if queries.device.type == "cuda" else 32  # interpreted: fewer, wider steps
    chunk, splits = plan_splits(b * hk, n)
    precision = dot_precision(queries.dtype)
    dev = queries.device
    part_o = torch.empty((b * hk * splits * group, d), dtype=torch.float32, device=dev)
    part_m = torch.empty((b * hk * splits * group,), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    dummy = torch.zeros(1, dtype=torch.long, device=dev)
    s_arg = slots if slots is not None else dummy
    s_strides = slots.stride() if slots is not None else (0, 0, 0)
    _decode_partial[(b * hk, splits)](
        queries, keys, values, s_arg, length if length is not None else dummy, part_o, part_m, part_l,
        queries.stride(0), queries.stride(1), queries.stride(3), *keys.stride(), *values.stride(), *s_strides,
        hk, group, n, d, qk_scale, chunk, splits,
        HAS_SLOTS=slots is not None, HAS_LEN=length is not None,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision,
    )  # fmt: skip
    out = torch.empty((b, hq, 1, d), dtype=queries.dtype, device=dev)
    _decode_merge[(b * hk, group)](
        part_o, part_m, part_l, out, out.stride(0), out.stride(1), out.stride(3), hk, group, d, splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
    )  # fmt: skip
    return out
