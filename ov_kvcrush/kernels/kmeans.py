"""Spherical k-means' iterations on the device, two launches each and no host sync (Triton).

ClusterKV clusters every layer's prompt keys (k-means over all KV heads at once, up to
``max_iters`` iterations: 10 by default, 20 when these figures were taken). Written as tensor
operations, an iteration is a ``matmul`` and an ``argmax`` over the ``[B, n, k]``
similarities, a ``scatter_add`` of the members, a norm, a ``where``, and the convergence test
``torch.equal`` -- a host sync. On an H100 (measured, 32k-token prompt, a Llama-3-8B shape)
that was 0.93 s of a 2.2 s prefill; with the assignment fused alone, still 409 ms of 1718
(21 %): ~10 launches an iteration, and every iteration waiting for the host.

Here an iteration is:

1. :func:`_assign_accumulate`: one program takes a tile of vectors, walks the centroid
   directions tile by tile with ``tl.dot`` keeping the running best (the first on ties, as
   ``argmax``; the similarities never leave registers), counts the vectors whose label moved,
   adds ``1 - cos`` to the objective, and adds each vector into its cluster's sum (atomics);
2. :func:`_renormalize`: each cluster's new direction is its sum, normalised (an empty cluster
   keeps its direction), and the sum is cleared for the next iteration.

Convergence (no label moved) is a device counter per iteration, read by the next iteration's
kernels, which then do nothing: the host launches ``max_iters`` iterations without waiting, and
the result is the reference's (:func:`ov_kvcrush.methods.clusterkv.lloyd_iterations`): the same
labels, directions, iteration count and objective. So the clustering can run on a stream of its
own beside the next layers' prefill, as the paper overlaps it (arXiv 2412.03213, Sec. IV-A).

Precision: ``ieee`` float32 products give the reference's labels (what the interpreted tests
check); the CUDA fast path asks for ``tf32`` tensor-core products, which can flip a vector whose
two nearest directions are within ~1e-3 in cosine, and its atomic sums add in any order -- a
departure of the fast path, not of the method. Runs on Triton 3.6 and 3.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _assign_accumulate(
    X, C, LABELS, SUMS, MOVED, LOSS, it,
    sxb, sxn, sxd,
    N, K, D,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # MOVED[it]: labels moved by the previous iteration (MOVED[0] = 1); 0 means converged
    if tl.load(MOVED + it) != 0:
        pid = tl.program_id(0)
        bb = tl.program_id(1)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k0 = tl.arange(0, BLOCK_K)
        ok = offs_m < N
        d_ok = offs_d < D
        x = tl.load(
            X + bb * sxb + offs_m[:, None] * sxn + offs_d[None, :] * sxd, mask=ok[:, None] & d_ok[None, :], other=0.0
        )
        best = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        label = tl.zeros([BLOCK_M], dtype=tl.int32)
        for start in range(0, K, BLOCK_K):
            offs_k = start + offs_k0
            ct = tl.load(
                C + bb * K * D + offs_k[None, :] * D + offs_d[:, None],
                mask=(offs_k[None, :] < K) & d_ok[:, None],
                other=0.0,
            )
            s = tl.dot(x, ct, input_precision=PRECISION)
            s = tl.where(offs_k[None, :] < K, s, float("-inf"))
            tile_best = tl.max(s, 1)
            # the first centroid of the tile reaching the tile's best (argmax's tie rule)
            tile_label = tl.min(tl.where(s == tile_best[:, None], offs_k[None, :], K), 1)
            better = tile_best > best  # an earlier tile keeps its centroid on a tie
            best = tl.where(better, tile_best, best)
            label = tl.where(better, tile_label, label)
        old = tl.load(LABELS + bb * N + offs_m, mask=ok, other=0)
        tl.store(LABELS + bb * N + offs_m, label.to(tl.int64), mask=ok)
        moved = tl.sum(tl.where(ok & (label.to(tl.int64) != old), 1, 0), 0)
        # relaxed: nothing here orders other memory (the default, acq_rel, fences every add)
        tl.atomic_add(MOVED + it + 1, moved, sem="relaxed")
        tl.atomic_add(LOSS + it, tl.sum(tl.where(ok, 1.0 - best, 0.0), 0), sem="relaxed")
        tl.atomic_add(
            SUMS + bb * K * D + label[:, None] * D + offs_d[None, :],
            x.to(tl.float32),
            mask=ok[:, None] & d_ok[None, :],
            sem="relaxed",
        )


@triton.jit
def _renormalize(
    SUMS, C, MOVED, it, K, D,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    bb = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_c[:, None] < K) & (offs_d[None, :] < D)
    at = bb * K * D + offs_c[:, None] * D + offs_d[None, :]
    if tl.load(MOVED + it + 1) != 0:  # the reference stops before updating once nothing moved
        s = tl.load(SUMS + at, mask=mask, other=0.0)
        norm = tl.sqrt(tl.sum(s * s, 1))
        old = tl.load(C + at, mask=mask, other=0.0)
        new = tl.where(norm[:, None] > 0, s / tl.maximum(norm, 1e-30)[:, None], old)
        tl.store(C + at, new, mask=mask)
        tl.store(SUMS + at, tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32), mask=mask)


def lloyd_on_device(
    xn: torch.Tensor, directions: torch.Tensor, max_iters: int, precision: str = "ieee"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spherical Lloyd iterations of unit vectors ``xn`` ``[B, n, d]`` (float32) from the unit
    ``directions`` ``[B, k, d]``, until no label moves or ``max_iters``; the host never waits.

    Returns ``(labels [B, n] int64, directions [B, k, d], iterations, objective)``, all on the
    device: ``iterations`` a 0-d int64 tensor (the assignment steps run), ``objective``
    ``[max_iters]`` float32 (``sum(1 - cos)`` after each step run, zeros after). ``precision``:
    ``ieee`` or ``tf32`` (the dot products)."""
    if xn.dim() != 3 or directions.dim() != 3 or xn.shape[::2] != directions.shape[::2]:
        raise ValueError(f"lloyd_on_device: x {tuple(xn.shape)}, directions {tuple(directions.shape)}")
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"lloyd_on_device: precision {precision!r} (ieee or tf32)")
    if max_iters < 1:
        raise ValueError(f"lloyd_on_device: max_iters {max_iters} (at least 1)")
    bsz, n, d = xn.shape
    k = directions.shape[1]
    dev = xn.device
    xn = xn.float()
    dirs = directions.float().contiguous().clone()
    labels = torch.full((bsz, n), -1, dtype=torch.long, device=dev)
    sums = torch.zeros((bsz, k, d), dtype=torch.float32, device=dev)
    moved = torch.zeros(max_iters + 1, dtype=torch.int32, device=dev)
    moved[0] = 1  # "the step before the first moved everything": the first step always runs
    loss = torch.zeros(max_iters, dtype=torch.float32, device=dev)
    cuda = dev.type == "cuda"
    block_m, block_k = (64, 64) if cuda else (32, 32)
    block_c = 16
    block_d = max(16, triton.next_power_of_2(d))
    for it in range(max_iters):
        _assign_accumulate[(triton.cdiv(n, block_m), bsz)](
            xn, dirs, labels, sums, moved, loss, it, *xn.stride(), n, k, d,
            BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d, PRECISION=precision,
        )  # fmt: skip
        _renormalize[(triton.cdiv(k, block_c), bsz)](
            sums, dirs, moved, it, k, d, BLOCK_C=block_c, BLOCK_D=block_d
        )  # fmt: skip
    iterations = (moved[:max_iters] != 0).sum()
    return labels, dirs, iterations, loss
