"""The GPU path's block pool grows (issue 71's item 7): one device buffer that starts at a chunk
and grows as blocks are asked for, the blocks held copied over, up to a budget capped by the
device's largest allocation. Run in the ``gpu_worker`` (Intel's OpenCL CPU runtime). Oracles: the
bytes written into each block, read back after every growth; the blocks in use."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

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


def _quant_blocks_in_a_budget(chunk_blocks: int, budget_blocks: int, takes: list[int]) -> dict:
    """A growing pool of ``budget_blocks`` f16 blocks and its 2-bit blocks (each chunk
    ``chunk_blocks`` f16 blocks' bytes): 2-bit blocks taken ``takes`` at a time, each filled with
    its own bytes, until the budget refuses; then full-precision blocks until it refuses. The
    sizes after each take, whether every 2-bit block kept its bytes, and the refusals."""
    from ov_kvcrush.gpu.layout import PoolShape, QuantShape
    from ov_kvcrush.gpu.pool import DevicePool
    from ov_kvcrush.gpu.runtime import GPUPathError

    shape = PoolShape("f16", BLOCK, HEAD_DIM, 4)
    chunk, DevicePool.CHUNK_BYTES = DevicePool.CHUNK_BYTES, chunk_blocks * shape.block_bytes
    try:
        pool = DevicePool(shape, blocks=budget_blocks, grow=True)
        blocks = pool.quant_blocks(QuantShape(16, HEAD_DIM, 16, 2, 2, 4))
    finally:
        DevicePool.CHUNK_BYTES = chunk
    qb, rng = blocks.shape.block_bytes, np.random.default_rng(1)
    held, sizes, out = {}, [], {"budget": budget_blocks * shape.block_bytes, "chunk": blocks.chunk}
    try:
        for n in takes:
            for block in blocks.take(n):
                held[block] = rng.integers(0, 256, qb, dtype=np.uint8)
                pool.dev.copy_bytes(pool.dev.to_device(held[block]), blocks.buffer, qb, block * qb)
            sizes.append((blocks.capacity, blocks.in_use, pool.capacity * shape.block_bytes + blocks.capacity * qb))
    except GPUPathError as e:
        out["quant refused"] = str(e)
    whole = pool.dev.to_host(blocks.buffer, np.uint8, (blocks.capacity * qb,))
    out["kept"] = all((whole[b * qb : (b + 1) * qb] == data).all() for b, data in held.items())
    try:
        while True:
            pool.allocate(1)
    except GPUPathError as e:
        out["fp refused"] = str(e)
    out["fp_bytes"], out["quant_bytes"] = pool.capacity * shape.block_bytes, blocks.capacity * qb
    return out | {"sizes": sizes}


def test_the_2bit_blocks_grow_by_a_chunk_or_a_tenth_within_the_pools_budget(gpu_worker):
    """MiniKV's 2-bit blocks (``QuantBlocks``) grow as the pool does, their bytes counted against
    the pool's budget beside the full-precision blocks' (as the CPU op counts them): at every size
    within a tenth and a chunk of the blocks held, the blocks' bytes kept through each growth,
    the whole never past the budget, and a take past it refused naming the budget's options, as
    is a full-precision block then."""
    got = gpu_worker.submit(_quant_blocks_in_a_budget, 2, 40, [5, 30, 1, 90, 200, 400, 800, 1600]).result(300)
    assert got["kept"]
    peak = 0
    for capacity, in_use, total in got["sizes"]:
        peak = max(peak, in_use)
        assert in_use <= capacity <= 1.1 * peak + got["chunk"] and total <= got["budget"], got["sizes"]
    assert len({c for c, _, _ in got["sizes"]}) >= 4  # it grew, step by step
    assert "2-bit blocks" in got["quant refused"] and "--kv-pool-mib" in got["quant refused"]
    assert "2-bit blocks" in got["fp refused"] and "max_kv_blocks" in got["fp refused"]
    assert got["fp_bytes"] + got["quant_bytes"] <= got["budget"]


def _arena_runs(steps: list[tuple[int, int]]) -> dict:
    """Take a run of ``take`` words and give back the ``give``-th run held (-1: none), per step,
    each run filled with its own words; the arena's capacity and words in use after each step,
    whether every held run still holds its words at the end, and each run's first word."""
    from ov_kvcrush.gpu.arena import IndexArena
    from ov_kvcrush.gpu.device import device

    dev = device()
    first, IndexArena.FIRST_WORDS = IndexArena.FIRST_WORDS, 64
    try:
        arena = IndexArena(dev)
    finally:
        IndexArena.FIRST_WORDS = first
    rng = np.random.default_rng(0)
    held: dict[int, np.ndarray] = {}
    sizes, starts = [], []
    for take, give in steps:
        start = arena.take(take)
        starts.append(start)
        held[start] = rng.integers(0, 1 << 30, take, dtype=np.int32)
        dev.copy_bytes(dev.to_device(held[start]), arena.buffer, 4 * take, 4 * start)
        if give >= 0:
            gone = sorted(held)[give]
            arena.give(gone, len(held.pop(gone)))
        sizes.append((arena.capacity, arena.in_use))
    words = dev.to_host(arena.buffer, np.int32, (arena.capacity,))
    kept = all((words[s : s + len(w)] == w).all() for s, w in held.items())
    spans = sorted((s, s + len(w)) for s, w in held.items())
    apart = all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    return {"sizes": sizes, "kept": kept, "apart": apart, "starts": starts, "in_use": sum(map(len, held.values()))}


def test_the_index_arena_hands_out_runs_apart_reuses_freed_ones_and_keeps_them_through_growth(gpu_worker):
    """ClusterKV's indexes for the GPU plugin's model (``IndexArena``): runs never overlap, a run
    given back (joined to its free neighbours) serves the next that fits, and the buffer doubles
    with every held run's words copied over. Oracle: the words written, read back at the end."""
    steps = [(40, -1), (20, -1), (10, 0), (30, -1), (100, -1), (15, 1), (45, -1), (5, -1)]
    got = gpu_worker.submit(_arena_runs, steps).result(timeout=300)
    assert got["kept"] and got["apart"]
    assert got["starts"][:3] == [0, 40, 60]
    assert got["starts"][3] == 0  # the first run's 40 words, freed, served the 30
    capacities = [c for c, _ in got["sizes"]]
    assert capacities[0] == 64 and capacities == sorted(capacities) and capacities[-1] > 64  # it grew
    assert got["sizes"][-1][1] == got["in_use"]


#: the largest allocation the emulated device shows, with Intel's relaxed allocation limits: past
#: the plugin's own buffers for these prompts (the tiny model's embedding is 384 KiB), below the
#: pool five of them fill (f32 blocks of 4 KiB: about 600 KiB)
EMULATED_MAX_ALLOC = 512 << 10
TOGETHER = [list(range(10 + i, 190 + i)) for i in range(5)]


def _together(model_dir: str, device: str) -> tuple[list[list[int]], int, tuple[int, int] | None]:
    """Five prompts' greedy tokens (the full cache, f32 blocks), all five in each step; the pool's
    bytes at the end (on GPU, grown from 8 blocks); and on GPU the emulation's counts of buffers
    made past the largest allocation and of faults."""
    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.gpu.pool import DevicePool
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    counting = device == "GPU"
    if counting:
        from ov_kvcrush.gpu import emulation

        before = emulation.counts()
        DevicePool.CHUNK_BYTES = 8 * BLOCK * HEAD_DIM * 2 * 4  # this worker serves this test alone
    engine = OpenVINOEngine(model_dir, device=device, kv_precision="f32", block_size=BLOCK, properties=F32)
    try:
        loop, settings = engine.batcher, GenerationSettings(max_new_tokens=5, ignore_eos=True)
        handles = [loop.add_request(i, ids, settings) for i, ids in enumerate(TOGETHER)]
        while loop.has_non_finished_requests():
            loop.step()
        tokens = [list(h.result().token_ids) for h in handles]
        if not counting:
            return tokens, 0, None
        pool = engine.pool.device_pool
        made = emulation.counts() - before
        return tokens, pool.capacity * pool.shape.block_bytes, (made.large_buffers, made.large_buffer_faults)
    finally:
        engine.close()


@pytest.mark.model
def test_a_pool_past_the_devices_largest_allocation_is_one_buffer_under_intels_relaxed_limits(
    tiny_llama3_ir, tmp_path, monkeypatch
):
    """Where the device lists ``cl_intel_relax_allocation_limits``, the pool grows past its largest
    single allocation (about 4 GiB on Arc cards) as one buffer made with
    ``CL_MEM_ALLOW_UNRESTRICTED_SIZE_INTEL``, and every kernel given it (the plugin's layers of
    ours, and our own) is built with ``-cl-intel-greater-than-4GB-buffer-required``. The emulation
    shows a largest allocation of 512 KiB and holds the process to the driver's contract (a buffer
    past it without the flag is refused; such a buffer given to a kernel built without the option
    is a fault: ``plugins/gpu/emulation/large_buffers.h``). Oracles: the CPU op's greedy tokens;
    the emulation's counts. Twice, each in a fresh process: the programs built from source, then
    loaded from the emulation's program cache (a kernel of a loaded program outlives the program
    the plugin built it from)."""
    from ov_kvcrush.gpu import emulation

    reason = emulation.unavailable()
    if reason:
        pytest.skip(reason)
    want = _together(tiny_llama3_ir, "CPU")[0]
    monkeypatch.setenv(emulation.PROGRAM_CACHE_ENV, str(tmp_path))
    for built in ("from source", "from the program cache"):
        with emulation.worker(max_allocation=EMULATED_MAX_ALLOC) as worker:
            tokens, pool_bytes, (made, faults) = worker.submit(_together, tiny_llama3_ir, "GPU").result(timeout=900)
        assert pool_bytes > EMULATED_MAX_ALLOC and made >= 1, built  # it grew past the limit, as one buffer
        assert faults == 0, built
        assert tokens == want, built
