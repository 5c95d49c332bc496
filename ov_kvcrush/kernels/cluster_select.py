"""ClusterKV's decode-step selection in two launches: score the clusters, then choose and place.

Written as tensor operations (score the centroids, a stable sort, prefix sums, gathers and
scatters, then the recall cache's counters), one layer's selection was ~25 small kernels; over
30 layers that cost ~3 ms a token on an H100 (measured), more than the attention it saves. Here,
per KV head (``row``):

1. :func:`_cluster_scores` (many programs a row): each cluster's score, ``q . mu`` summed over
   the head's query group (float32, as :func:`ov_kvcrush.methods.clusterkv.rank_clusters`). Its
   first program also moves the recall cache's ring pointer on, so that the next launch, whose
   programs all read it, never races a write of it;
2. :func:`_choose_clusters` (one program a row, inside :func:`_choose_and_place`): the budget's
   boundary without ranking: a bisection over the scores (as order-preserving integers, 33
   steps) for the lowest score whose higher-scoring clusters hold fewer tokens than the budget.
   Those are recalled whole; the clusters at exactly that score share what is left in
   cluster-id order (the reference's stable order), the last one trimmed to its earliest
   tokens. Each cluster's first place in the selection is the prefix sum of what is taken, in
   cluster order. The recall cache's ring (the clusters recalled at the last ``R`` steps) and
   its three counters (lookups, hits, tokens loaded) are updated here, as the reference counts
   them;
3. placing, in the same program: each chosen cluster's id is written at its first place of the
   selection row, a running maximum over the places gives every place its cluster and that
   cluster's first place, and the token at that rank inside the cluster replaces the id. An
   earlier version placed in a third launch, one lane per place binary-searching the prefix
   sums (``profile_cuda_llama3_8b_random_128k_h200.json``: 0.12 ms of a step at 128k, and a
   launch a layer).

The recalled tokens are the reference's; they are listed cluster by cluster in id order, not in
ranked order (attention does not depend on the order). Two earlier versions ranked every
cluster: one by summing, for each cluster, the sizes of all clusters ahead of it (quadratic in
the clusters: at 128k tokens, 1,600 clusters a head, 2.05 ms of a step on an H200), one by a
bitonic sort per row (1.65 ms: a sort's 66 stages of data exchange in one program); both
measured in ``docs/results/bench/profile_cuda_llama3_8b_random_128k_h200*.json``. A row of more
than :data:`MAX_RANKED_CLUSTERS` clusters is past one program's registers: :func:`rankable` says
so and the caller selects with tensor operations.

No host sync, fixed shapes: a CUDA graph captures it. Tested against the reference selection in
Triton's interpreter (``tests/test_kernels.py``, ``tests/test_fastpath.py``). Runs on Triton 3.6
and 3.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: the most clusters one row's program chooses among (it holds them in registers); 16384
#: clusters of ClusterKV's 80 tokens cover 1.3M tokens
MAX_RANKED_CLUSTERS = 16384


@triton.jit
def _cluster_scores(
    Q, CENT, SCORES, PTR,
    sqb, sqh, sqd, scr, scc, scd,
    HK, GROUP, C, D, R,
    HAS_RING: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if HAS_RING:  # the first program moves the ring on: the next launch writes the row before it
        if (row == 0) & (tl.program_id(1) == 0):
            tl.store(PTR, (tl.load(PTR) + 1) % R)
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
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _choose_clusters(
    SCORES, SIZES, RING, PTR, COUNTS, ssr, ssc, srr, srw, src, C, BUDGET, R,
    HAS_RING: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One row's choice (step 2 of the module doc): ``(taken, first place)`` per cluster, in
    cluster order; the recall cache's ring row and counters updated."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < C
    score = tl.load(SCORES + row * C + offs, mask=ok, other=0.0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties +0.0, as in the reference's sort
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # the floats' order, as integers
    key = tl.where(ok, key, -2147483648)
    size = tl.load(SIZES + row * ssr + offs * ssc, mask=ok, other=0).to(tl.int32)
    take = tl.minimum(tl.sum(size, 0), BUDGET)
    # the boundary: the lowest key v whose clusters above it hold fewer tokens than the budget
    lo = tl.full([], -2147483649, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(33):
        mid = (lo + hi) >> 1
        above = tl.sum(tl.where(key > mid, size, 0), 0)
        go_down = above < BUDGET
        hi = tl.where(go_down, mid, hi)
        lo = tl.where(go_down, lo, mid + 1)
    whole = key > hi  # taken whole; the clusters at the boundary's score share what is left, lower ids first
    left = take - tl.sum(tl.where(whole, size, 0), 0)
    tie = tl.where(ok & (key == hi), size, 0)
    before = tl.cumsum(tie, 0) - tie
    taken = tl.where(whole, size, tl.minimum(tie, tl.maximum(left - before, 0)))
    chosen = ok & (taken > 0)
    cached = offs < 0  # all false
    if HAS_RING:  # the scores' launch moved the pointer on: this step's row is the one before it
        ptr = (tl.load(PTR) + R - 1) % R
        for r in range(R):
            cached = cached | (tl.load(RING + r * srr + row * srw + offs * src, mask=ok, other=0) != 0)
        tl.store(RING + ptr * srr + row * srw + offs * src, chosen.to(tl.int8), mask=ok)
    fresh = chosen & (cached.to(tl.int32) == 0)
    tl.atomic_add(COUNTS + 0, tl.sum(chosen.to(tl.int64), 0))
    tl.atomic_add(COUNTS + 1, tl.sum((chosen & cached).to(tl.int64), 0))
    tl.atomic_add(COUNTS + 2, tl.sum(tl.where(fresh, size, 0).to(tl.int64), 0))
    return taken, tl.cumsum(taken, 0) - taken


@triton.jit
def _choose_and_place(
    SCORES, SIZES, OFFSETS, TOKENS, SLOTS, RING, PTR, COUNTS,
    ssr, ssc, sor, soc, str_, stn, slr, sln, srr, srw, src,
    C, BUDGET, TAKE, OFFSET, R,
    HAS_RING: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    taken, first = _choose_clusters(
        SCORES, SIZES, RING, PTR, COUNTS, ssr, ssc, srr, srw, src, C, BUDGET, R,
        HAS_RING=HAS_RING, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    # step 3: the selection row's recalled places first hold, at each chosen cluster's first
    # place, that cluster's id (-1 elsewhere); a running maximum over the places then gives
    # every place its cluster and that cluster's first place
    out = SLOTS + row * slr + OFFSET * sln
    for p0 in range(0, TAKE, BLOCK_P):
        places = p0 + tl.arange(0, BLOCK_P)
        tl.store(out + places * sln, -1, mask=places < TAKE)
    tl.debug_barrier()  # the -1s before the ids (another thread may own a place)
    cids = tl.arange(0, BLOCK_C)
    tl.store(out + first * sln, cids.to(tl.int64), mask=(cids < C) & (taken > 0))
    tl.debug_barrier()  # every id written before any place reads them
    cid_before = tl.full([], -1, tl.int64)
    start_before = tl.full([], -1, tl.int64)
    for p0 in range(0, TAKE, BLOCK_P):
        places = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        ok = places < TAKE
        mark = tl.load(out + places * sln, mask=ok, other=-1)
        cid = tl.maximum(tl.associative_scan(mark, 0, _max), cid_before)
        start = tl.maximum(tl.associative_scan(tl.where(mark >= 0, places, -1), 0, _max), start_before)
        cid_before = tl.max(cid, 0)
        start_before = tl.max(start, 0)
        cid = tl.where(ok, cid, 0)
        begin = tl.load(OFFSETS + row * sor + cid * soc, mask=ok, other=0)
        tok = tl.load(TOKENS + row * str_ + (begin + places - start) * stn, mask=ok, other=0)
        tl.store(out + places * sln, tok, mask=ok)


def rankable(clusters: int) -> bool:
    """Whether one program chooses among ``clusters`` clusters (:data:`MAX_RANKED_CLUSTERS`)."""
    return clusters <= MAX_RANKED_CLUSTERS


def select_recalled(
    queries: torch.Tensor,
    centroids: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
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
    ``offset .. offset + min(budget, N) - 1`` (cluster by cluster, in id order), and count the
    recall cache.

    Args:
        queries: ``[b, hq, 1, d]``; ``rows = b * hk`` KV heads, ``hq`` a multiple of ``hk``.
        centroids: ``[rows, C, d]``; ``sizes``: ``[rows, C]`` int64 tokens per cluster;
            ``offsets``: ``[rows, C (+ 1)]`` each cluster's first index in ``sorted_tokens``.
        sorted_tokens: ``[rows, N]`` int64: the clustered tokens' store slots sorted by cluster
            (ties by slot).
        budget: tokens recalled at most (the config's budget less the sinks).
        counts: ``[3]`` int64 on the device: lookups, hits, tokens loaded (added to).
        ring, ring_ptr: the recall cache (``[R, rows, C]`` int8, ``[1]`` int64), or ``None``.
    """
    b, hq, t, d = queries.shape
    rows, c, _ = centroids.shape
    n = sorted_tokens.shape[1]
    if t != 1 or rows % b or hq % (rows // b) or centroids.shape[2] != d:
        raise ValueError(f"select_recalled: queries {tuple(queries.shape)}, centroids {tuple(centroids.shape)}")
    if not rankable(c):
        raise ValueError(f"select_recalled: {c} clusters a row, more than one program holds ({MAX_RANKED_CLUSTERS})")
    hk = rows // b
    dev = queries.device
    cuda = dev.type == "cuda"
    block_d = max(16, triton.next_power_of_2(d))
    block_c = 32 if cuda else 16
    has_ring = ring is not None and ring_ptr is not None
    ring_arg = ring if has_ring else counts
    ptr_arg = ring_ptr if has_ring else counts
    r_strides = ring.stride() if has_ring else (0, 0, 0)
    r_count = ring.shape[0] if has_ring else 1
    scores = torch.empty((rows, c), dtype=torch.float32, device=dev)
    _cluster_scores[(rows, triton.cdiv(c, block_c))](
        queries, centroids, scores, ptr_arg, queries.stride(0), queries.stride(1), queries.stride(3),
        *centroids.stride(), hk, hq // hk, c, d, r_count, HAS_RING=has_ring, BLOCK_C=block_c, BLOCK_D=block_d,
    )  # fmt: skip
    block_all = max(16, triton.next_power_of_2(c))
    take = min(budget, n)
    block_p = min(max(16, triton.next_power_of_2(take)), 2048 if cuda else 256)
    _choose_and_place[(rows,)](
        scores, sizes, offsets, sorted_tokens, slots, ring_arg, ptr_arg, counts,
        *sizes.stride(), *offsets.stride(), *sorted_tokens.stride(), *slots.stride(), *r_strides,
        c, budget, take, offset, r_count,
        HAS_RING=has_ring, BLOCK_C=block_all, BLOCK_P=block_p, num_warps=min(16, max(4, block_all // 256)),
    )  # fmt: skip
