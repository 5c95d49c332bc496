"""Causal flash attention that also returns per-head column sums of the probabilities (Triton).

MiniKV (arXiv 2411.18077, seed 003) makes heavy-hitter selection compatible with FlashAttention
by a kernel that returns, beside the output, the cumulative attention each key received. The
same numbers drive H2O's accumulators and KVCrush's signatures here. Two passes, neither of
which materialises the ``[t, n]`` attention matrix:

1. :func:`_flash_forward`: the usual online-softmax forward over key tiles (causal, grouped-query
   heads read their KV head in place), writing the output and each row's log-sum-exp;
2. :func:`_column_sums`: per key tile, the sum over query rows of ``exp(q.k * scale - lse)``,
   which is exactly the normalised probability: the queries' logits are recomputed (the
   FlashAttention backward's trick) instead of stored.

Where this departs from MiniKV's kernel: theirs fuses the score accumulation into the forward
pass with an atomic add per key tile; two passes cost one more ``Q K^T`` but need no atomics and
give the same sums in every run. Rows before ``score_from`` attend but are not summed (SnapKV's
observation window, MiniKV's prompt-only scores).

Runs on Triton 3.6 (the GPU image) and 3.9 (CI, interpreted on CPU tensors): only ``tl.load``
with masks, ``tl.dot``, ``tl.exp2`` and scalar loop bounds.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ov_kvcrush.kernels import LOG2E, dot_precision


@triton.jit
def _flash_forward(
    Q, K, V, Out, LSE,
    sqb, sqh, sqt, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, sot, sod,
    HQ, GROUP, T, N, D, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    q_pos = offs_m + (N - T)  # absolute position of each query row (the prompt ends at N)
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(N, (pid_m + 1) * BLOCK_M + (N - T))  # keys past the tile's last row are masked
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start in range(0, hi, BLOCK_N):
        offs_n = start + offs_n0
        kt = tl.load(
            k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
            mask=(offs_n[None, :] < N) & (offs_d[:, None] < D),
            other=0.0,
        )
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < N)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * svn + offs_d[None, :] * svd,
            mask=(offs_n[:, None] < N) & (offs_d[None, :] < D),
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(
        Out + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
        acc.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < T) & (offs_d[None, :] < D),
    )
    tl.store(LSE + bh * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)


@triton.jit
def _column_sums(
    Q, K, LSE, S,
    sqb, sqh, sqt, sqd, skb, skh, skn, skd,
    HQ, GROUP, T, N, D, qk_scale, ROW_FROM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m0 = tl.arange(0, BLOCK_M)
    kt = tl.load(
        K + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
        mask=(offs_n[None, :] < N) & (offs_d[:, None] < D),
        other=0.0,
    )
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    # the first query row that sees any key of this tile, and not before ROW_FROM
    lo = tl.maximum(ROW_FROM, pid_n * BLOCK_N - (N - T))
    lo = (lo // BLOCK_M) * BLOCK_M
    for start in range(lo, T, BLOCK_M):
        offs_m = start + offs_m0
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
            mask=(offs_m[:, None] < T) & (offs_d[None, :] < D),
            other=0.0,
        )
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        q_pos = offs_m + (N - T)
        counted = (offs_n[None, :] <= q_pos[:, None]) & (offs_m[:, None] >= ROW_FROM) & (offs_m[:, None] < T)
        p = tl.where(counted, tl.exp2(s - lse[:, None]), 0.0)
        total += tl.sum(p, 0)
    tl.store(S + bh * N + offs_n, total, mask=offs_n < N)


def launch_config(d: int, device: torch.device) -> tuple[dict[str, int], dict[str, int]]:
    """Tiles and launch settings of the forward pass and of the column sums, for head dim ``d``.

    On CUDA, head dims up to 128: 128 query rows by 64 keys per tile, 8 warps, 3 pipeline stages
    (the usual flash-attention tiling for Hopper); the column sums take 128 keys by 64 rows. The
    interpreter gets 32 x 32 tiles: fewer interpreted steps than 16 x 16 (each step is Python
    work), and the tests' shapes (19-45 rows and keys) still cross tiles.
    """
    block_d = max(16, triton.next_power_of_2(d))
    if device.type != "cuda":
        small = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": block_d}
        return small, dict(small)
    if block_d <= 128:
        return (
            {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": block_d, "num_warps": 8, "num_stages": 3},
            {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": block_d, "num_warps": 8, "num_stages": 3},
        )
    wide = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": block_d, "num_warps": 4}
    return wide, dict(wide)


def flash_attention_with_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    *,
    return_scores: bool = True,
    score_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of the last ``t`` positions of an ``n``-token sequence, plus column sums.

    Args:
        queries: ``[b, hq, t, d]`` (``t <= n``: query row ``i`` is at position ``n - t + i``).
        keys, values: ``[b, hk, n, d]``; ``hq`` a multiple of ``hk``. Any strides.
        scale: logit scale, ``1/sqrt(d)`` by default.
        return_scores: also return ``[b, hq, n]`` float32: per query head, each key's attention
            probability summed over query rows ``score_from .. t-1``.
        score_from: first query row whose probabilities are summed.

    Returns ``(output [b, hq, t, d] in the query dtype, scores or None)``; the same as
    :func:`ov_kvcrush.methods.attention.attend` with causal positions (tested against it).
    """
    b, hq, t, d = queries.shape
    hk, n = keys.shape[1], keys.shape[2]
    if hq % hk or t > n or keys.shape[3] != d or not 0 <= score_from <= t:
        raise ValueError(
            f"flash_attention_with_scores: queries {tuple(queries.shape)}, keys {tuple(keys.shape)}, "
            f"score_from={score_from}"
        )
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    fwd, sums = launch_config(d, queries.device)
    precision = dot_precision(queries.dtype)
    out = torch.empty_like(queries, memory_format=torch.contiguous_format)
    lse = torch.empty((b * hq, t), dtype=torch.float32, device=queries.device)
    strides = (*queries.stride(), *keys.stride(), *values.stride(), *out.stride())
    _flash_forward[(triton.cdiv(t, fwd["BLOCK_M"]), b * hq)](
        queries, keys, values, out, lse, *strides, hq, hq // hk, t, n, d, qk_scale, PRECISION=precision, **fwd,
    )  # fmt: skip
    if not return_scores:
        return out, None
    scores = torch.empty((b, hq, n), dtype=torch.float32, device=queries.device)
    _column_sums[(triton.cdiv(n, sums["BLOCK_N"]), b * hq)](
        queries, keys, lse, scores, *queries.stride(), *keys.stride(), hq, hq // hk, t, n, d, qk_scale, score_from,
        PRECISION=precision, **sums,
    )  # fmt: skip
    return out, scores
