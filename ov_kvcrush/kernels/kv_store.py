"""A decode step's token written into a preallocated store in one launch (Triton).

The fast path's store (:class:`~ov_kvcrush.fastpath.buffer.KVBuffer`) takes each decode step's
key and value at the device count ``n`` (``[1]`` int64), then counts the token. As torch
operations that is three kernels a layer (two ``index_copy_`` and an ``add_``): ~100 launches
of a Llama-3-8B step, each a few microseconds of a replayed graph's time. Here one program
writes every row's key and value at ``n`` and then advances ``n``: every thread has read ``n``
before the barrier, so the count moves only after all of them placed the token.

Tested against the torch operations in Triton's interpreter (``tests/test_kernels.py``).
Runs on Triton 3.6 and 3.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows(
    SRC, DST, pos, ssb, ssh, ssd, sdb, sdh, sdn, sdd, HK, ROWS, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Copy ``SRC[b, h, 0, :]`` to ``DST[b, h, pos, :]`` for every row ``b * HK + h``."""
    offs_d = tl.arange(0, BLOCK_D)
    for r0 in range(0, ROWS, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        b = (r // HK)[:, None]
        h = (r % HK)[:, None]
        ok = (r < ROWS)[:, None] & (offs_d < D)[None, :]
        x = tl.load(SRC + b * ssb + h * ssh + offs_d[None, :] * ssd, mask=ok, other=0.0)
        tl.store(DST + b * sdb + h * sdh + pos * sdn + offs_d[None, :] * sdd, x, mask=ok)


@triton.jit
def _append_token(
    K, V, KS, VS, N,
    skb, skh, skd, svb, svh, svd,
    sKb, sKh, sKn, sKd, sVb, sVh, sVn, sVd,
    HK, ROWS, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pos = tl.load(N)
    _copy_rows(K, KS, pos, skb, skh, skd, sKb, sKh, sKn, sKd, HK, ROWS, D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    _copy_rows(V, VS, pos, svb, svh, svd, sVb, sVh, sVn, sVd, HK, ROWS, D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    tl.debug_barrier()  # every thread has read the count: only now may it move
    tl.store(N, pos + 1)


def append_token(
    keys_store: torch.Tensor, values_store: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: torch.Tensor
) -> None:
    """Write one token's ``keys``/``values`` ``[b, hk, 1, d]`` (any strides) into the stores
    ``[b, hk, capacity, d]`` at slot ``n`` (``[1]`` int64 on the device), then add one to ``n``.
    The caller keeps ``n`` under the capacity (the store grows on the host, before the step)."""
    b, hk, _, d = keys_store.shape
    if values_store.shape != keys_store.shape or keys.shape != (b, hk, 1, d) or values.shape != keys.shape:
        raise ValueError(
            f"append_token: stores {tuple(keys_store.shape)}/{tuple(values_store.shape)}, "
            f"token {tuple(keys.shape)}/{tuple(values.shape)}"
        )
    if n.numel() != 1 or n.dtype != torch.long:
        raise ValueError(f"append_token: n must be one int64, got {tuple(n.shape)} {n.dtype}")
    rows = b * hk
    block_d = max(16, triton.next_power_of_2(d))
    block_r = max(1, min(triton.next_power_of_2(rows), 4096 // block_d))
    _append_token[(1,)](
        keys, values, keys_store, values_store, n,
        keys.stride(0), keys.stride(1), keys.stride(3), values.stride(0), values.stride(1), values.stride(3),
        *keys_store.stride(), *values_store.stride(), hk, rows, d,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
