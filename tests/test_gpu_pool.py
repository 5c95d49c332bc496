"""The GPU path's block pool grows (issue 71's item 7): one device buffer that starts at a chunk
and grows as blocks are asked for, the blocks held copied over, up to a budget capped by the
device's largest allocation. Run in the ``gpu_worker`` (Intel's OpenCL CPU runtime). Oracles: the
bytes written into each block, read back after every growth; the blocks in use."""

from __future__ import annotations

import numpy as np

BLOCK, HEAD_DIM = 16, 32


def _grow_and_read_back(chunk_blocks: int, steps: list[tuple[int, int]]) -> dict:
    """Allocate ``take`` blocks and release ``give`` of those held, per step, each new block filled
    with its own bytes; the pool's capacity and blocks in use after each step's allocation, and
    whether every held block still holds its bytes at the end."""
    from ov_kvcrush.gpu.layout import PoolShape
    from ov_kvcrush.gpu.pool import DevicePool

    shape = PoolShape("f32", BLOCK, HEAD_DIM, 4)
    chunk, DevicePool.CHUNK_BYTES = DevicePool.CHUNK_BYTES, chunk_blocks * shape.block_bytes
    try:
        pool = DevicePool(shape, blocks=10_000, grow=True)  # its chunk fixed when made
    finally:
        DevicePool.CHUNK_BYTES = chunk
    bb, held, sizes = shape.block_bytes, {}, []
    rng = np.random.default_rng(0)
    for take, give in steps:
        for block in pool.allocate(take):
            held[block] = rng.integers(0, 256, bb, dtype=np.uint8)
            pool.dev.copy_bytes(pool.dev.to_device(held[block]), pool.buffer, bb, block * bb)
        sizes.append((pool.capacity, pool.blocks_in_use))
        dropped = list(held)[:give]
        pool.release(dropped)
        for block in dropped:
            del held[block]
    whole = pool.dev.to_host(pool.buffer, np.uint8, (pool.capacity * bb,))
    kept = all((whole[b * bb : (b + 1) * bb] == data).all() for b, data in held.items())
    return {"sizes": sizes, "kept": kept, "chunk": pool.chunk, "in_use": len(held)}


def _refusals() -> dict:
    from ov_kvcrush.gpu.layout import PoolShape
    from ov_kvcrush.gpu.pool import DevicePool
    from ov_kvcrush.gpu.runtime import GPUPathError

    shape = PoolShape("f16", BLOCK, HEAD_DIM, 4)
    out = {}
    small = DevicePool(shape, blocks=20, grow=True)
    small.allocate(20)
    try:
        small.allocate(1)
    except GPUPathError as e:
        out["budget"] = str(e)
    huge = DevicePool(shape, blocks=1 << 40, grow=True)
    out["capped"] = (huge.blocks, huge.dev.largest_allocation() // shape.block_bytes, huge.limit_reason, huge.capacity)
    return out


def test_a_growing_pool_keeps_its_blocks_within_a_tenth_and_a_chunk_of_what_it_holds(gpu_worker):
    steps = [(3, 0), (9, 2), (30, 0), (1, 20), (15, 0), (200, 0), (40, 100), (90, 0)]
    got = gpu_worker.submit(_grow_and_read_back, 8, steps).result(timeout=300)
    assert got["kept"]  # every held block's bytes survived each growth's copy
    capacities = [c for c, _ in got["sizes"]]
    assert capacities[0] == got["chunk"] == 8 and len(set(capacities)) >= 4  # it grew, step by step
    peak = 0
    for capacity, in_use in got["sizes"]:  # the buffer does not shrink: bounded by the most held
        peak = max(peak, in_use)
        assert in_use <= capacity <= 1.1 * peak + got["chunk"], got["sizes"]
    assert capacities == sorted(capacities)
    assert capacities[4] == capacities[3]  # the blocks freed at step 4 served step 5: no growth
    assert got["sizes"][-1][1] == got["in_use"]  # the last step releases none


def test_a_pool_past_its_budget_is_refused_and_a_budget_past_one_allocation_is_capped(gpu_worker):
    got = gpu_worker.submit(_refusals).result(timeout=300)
    assert "21 needed, 20 at most" in got["budget"] and "max_kv_blocks" in got["budget"]
    blocks, fits, reason, capacity = got["capped"]
    assert blocks == fits and "largest allocation" in reason
    assert capacity < blocks  # a chunk allocated, not the budget
