"""ClusterKV's decode-step selection in three launches: rank the clusters, place the recalled tokens.

Written as tensor operations (score the centroids, a stable sort, prefix sums, gathers and
scatters, then the recall cache's counters), one layer's selection was ~25 small kernels; over
30 layers that cost ~3 ms a token on an H100 (measured), more than the attention it saves. Here,
per KV head (``row``):

1. :func:`_cluster_scores`: each cluster's score, ``q . mu`` summed over the head's query group
   (float32, as :func:`ov_kvcrush.methods.clusterkv.rank_clusters`);
2. :func:`_cluster_starts`: each cluster's first place in the ranked order, without sorting: the
   sizes of the clusters ranked before it (a higher score, or an equal one and a lower id: the
   stable descending order), summed over all pairs. A cluster is recalled when its start is under
   the budget; the recall cache's ring (the clusters recalled at the last ``R`` steps) and its
   three counters (lookups, hits, tokens loaded) are updated here, as the reference counts them;
3. :func:`_place_recalled`: each clustered token's place is its cluster's start plus its rank
   inside the cluster; the recalled ones (places under ``take``) are written to the selection
   buffer. The first program also advances the ring's pointer (after step 2 read it).

No host sync, fixed shapes: a CUDA graph captures it. Tested against the reference selection in
Triton's interpreter (``tests/test_fastpath.py``). Runs on Triton 3.6 and 3.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cluster_scores(
    Q, CENT, SCORES,
    sqb, sqh, sqd, scr, scc, scd,
    HK, GROUP, C, D,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    b = row // HK
    hk = row % HK
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    c_ok = offs_c < C
    mu = tl.load(
        CENT + row * scr + offs_c[:, None] * scc + offs_d[None, :] * scd,
        mask=c_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for g in range(GROUP):
        q = tl.load(Q + b * sqb + (hk * GROUP + g) * sqh + offs_d * sqd, mask=offs_d < D, other=0.0).to(tl.float32)
        acc += tl.sum(mu * q[None, :], 1)
    tl.store(SCORES + row * C + offs_c, acc, mask=c_ok)


@triton.jit
def _cluster_starts(
    SCORES, SIZES, START, RING, PTR, COUNTS,
    ssr, ssc, srr, srw, src,
    C, BUDGET, R,
    HAS_RING: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    s_c = tl.load(SCORES + row * C + offs_c, mask=c_ok, other=0.0)
    start = tl.zeros([BLOCK_C], dtype=tl.int64)
    for j0 in range(0, C, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < C
        s_j = tl.load(SCORES + row * C + offs_j, mask=j_ok, other=0.0)
        z_j = tl.load(SIZES + row * ssr + offs_j * ssc, mask=j_ok, other=0)
        ahead = (s_j[None, :] > s_c[:, None]) | ((s_j[None, :] == s_c[:, None]) & (offs_j[None, :] < offs_c[:, None]))
        start += tl.sum(tl.where(ahead & j_ok[None, :], z_j[None, :], 0), 1)
    tl.store(START + row * C + offs_c, start, mask=c_ok)
    size_c = tl.load(SIZES + row * ssr + offs_c * ssc, mask=c_ok, other=0)
    chosen = c_ok & (start < BUDGET) & (size_c > 0)
    cached = offs_c < 0  # all false
    if HAS_RING:
        ptr = tl.load(PTR)
        for r in range(R):
            cached = cached | (tl.load(RING + r * srr + row * srw + offs_c * src, mask=c_ok, other=0) != 0)
        tl.store(RING + ptr * srr + row * srw + offs_c * src, chosen.to(tl.int8), mask=c_ok)
    fresh = chosen & (cached.to(tl.int32) == 0)
    tl.atomic_add(COUNTS + 0, tl.sum(chosen.to(tl.int64), 0))
    tl.atomic_add(COUNTS + 1, tl.sum((chosen & cached).to(tl.int64), 0))
    tl.atomic_add(COUNTS + 2, tl.sum(tl.where(fresh, size_c, 0).to(tl.int64), 0))


@triton.jit
def _place_recalled(
    START, LABELS, WITHIN, TOKENS, SLOTS, PTR,
    slr, sln, swr, swn, str_, stn, sor, son,
    C, N, TAKE, OFFSET, R,
    HAS_RING: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pid = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    lab = tl.load(LABELS + row * slr + offs * sln, mask=ok, other=0)
    within = tl.load(WITHIN + row * swr + offs * swn, mask=ok, other=0)
    tok = tl.load(TOKENS + row * str_ + offs * stn, mask=ok, other=0)
    place = tl.load(START + row * C + lab, mask=ok, other=0) + within
    tl.store(SLOTS + row * sor + (OFFSET + place) * son, tok, mask=ok & (place < TAKE))
    if HAS_RING:  # the first program moves the ring on (the previous launch has read it)
        ptr = tl.load(PTR)
        tl.store(PTR, (ptr + 1) % R, mask=(row == 0) & (pid == 0))


def select_recalled(
    queries: torch.Tensor,
    centroids: torch.Tensor,
    sizes: torch.Tensor,
    sorted_labels: torch.Tensor,
    within: torch.Tensor,
    sorted_tokens: torch.Tensor,
    *,
    budget: int,
    slots: torch.Tensor,
    offset: int,
    counts: torch.Tensor,
    ring: torch.Tensor | None,
    ring_ptr: torch.Tensor | None,
) -> None:
    """Write one decode step's recalled tokens into ``slots`` ``[rows, L]`` at columns
    ``offset .. offset + min(budget, N) - 1``, in ranked order, and count the recall cache.

    Args:
        queries: ``[b, hq, 1, d]``; ``rows = b * hk`` KV heads, ``hq`` a multiple of ``hk``.
        centroids: ``[rows, C, d]``; ``sizes``: ``[rows, C]`` int64 tokens per cluster.
        sorted_labels, within, sorted_tokens: ``[rows, N]`` int64: the clustered tokens sorted by
            cluster, each one's cluster, its rank inside it, its store slot.
        budget: tokens recalled at most (the config's budget less the sinks).
        counts: ``[3]`` int64 on the device: lookups, hits, tokens loaded (added to).
        ring, ring_ptr: the recall cache (``[R, rows, C]`` int8, ``[1]`` int64), or ``None``.
    """
    b, hq, t, d = queries.shape
    rows, c, _ = centroids.shape
    n = sorted_tokens.shape[1]
    if t != 1 or rows % b or hq % (rows // b) or centroids.shape[2] != d:
        raise ValueError(f"select_recalled: queries {tuple(queries.shape)}, centroids {tuple(centroids.shape)}")
    hk = rows // b
    dev = queries.device
    block_d = max(16, triton.next_power_of_2(d))
    block_c = 32 if dev.type == "cuda" else 16
    scores = torch.empty((rows, c), dtype=torch.float32, device=dev)
    start = torch.empty((rows, c), dtype=torch.int64, device=dev)
    _cluster_scores[(rows, triton.cdiv(c, block_c))](
        queries, centroids, scores, queries.stride(0), queries.stride(1), queries.stride(3), *centroids.stride(),
        hk, hq // hk, c, d, BLOCK_C=block_c, BLOCK_D=block_d,
    )  # fmt: skip
    has_ring = ring is not None and ring_ptr is not None
    ring_arg = ring if has_ring else counts
    ptr_arg = ring_ptr if has_ring else counts
    r_strides = ring.stride() if has_ring else (0, 0, 0)
    r_count = ring.shape[0] if has_ring else 1
    _cluster_starts[(rows, triton.cdiv(c, block_c))](
        scores, sizes, start, ring_arg, ptr_arg, counts, *sizes.stride(), *r_strides, c, budget, r_count,
        HAS_RING=has_ring, BLOCK_C=block_c, BLOCK_J=64 if dev.type == "cuda" else 16,
    )  # fmt: skip
    block = 256 if dev.type == "cuda" else 64
    _place_recalled[(rows, triton.cdiv(n, block))](
        start, sorted_labels, within, sorted_tokens, slots, ptr_arg,
        *sorted_labels.stride(), *within.stride(), *sorted_tokens.stride(), *slots.stride(),
        c, n, min(budget, n), offset, r_count, HAS_RING=has_ring, BLOCK=block,
    )  # fmt: skip
