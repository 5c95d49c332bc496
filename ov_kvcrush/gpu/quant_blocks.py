"""The 2-bit store's blocks on the GPU path's device (MiniKV's chunks, or ``quant`` under a
method): one buffer shared by a pool's layer caches, since the GPU plugin's model reads every
layer's from one input.

It grows as the pool's full-precision blocks do (:class:`~ov_kvcrush.gpu.pool.DevicePool`): a
chunk at first, then as :func:`~ov_kvcrush.gpu.growth.grow_blocks` grows a buffer of blocks (a
frozen selection keeps every generated token, so its chunks keep coming). Its bytes count
against the pool's budget beside the full-precision blocks', as the CPU op counts 2-bit blocks
by their bytes (``paged_cache.cpp``), and one buffer stays within the device's largest
allocation.
"""

from __future__ import annotations

from collections.abc import Callable

from ov_kvcrush.gpu.device import KernelDevice
from ov_kvcrush.gpu.growth import grow_blocks
from ov_kvcrush.gpu.layout import QuantShape
from ov_kvcrush.gpu.runtime import GPUPathError


class QuantBlocks:
    """2-bit blocks of ``shape`` in one buffer of ``dev``, grown by ``chunk_bytes`` (or a tenth)
    within ``spare_bytes()``: the bytes the budget leaves beside everything allocated (None: no
    budget over them, a pool allocated whole up front); ``budget`` names that bound in errors."""

    def __init__(self, dev: KernelDevice, shape: QuantShape, chunk_bytes: int,
                 spare_bytes: Callable[[], int | None], budget: str) -> None:  # fmt: skip
        self.dev = dev
        self.shape = shape
        self.budget = budget
        self._spare = spare_bytes
        largest = dev.largest_allocation()
        #: the most blocks one buffer holds (the device's largest allocation); None: not said
        self.largest = None if largest is None else largest // shape.block_bytes
        self.chunk = max(1, chunk_bytes // shape.block_bytes)
        self.capacity = max(1, min(self.chunk, self._most(0)))
        self.buffer = dev.empty(self.capacity * shape.block_bytes)  # a block taken is written whole
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def allocated_bytes(self) -> int:
        return self.capacity * self.shape.block_bytes

    def take(self, n: int) -> list[int]:
        """``n`` free blocks' ids (the buffer grown first where too few are free)."""
        if n > len(self._free):
            self._grow(self.capacity + n - len(self._free))
        return [self._free.pop() for _ in range(n)]

    def give(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))

    def _most(self, held: int) -> int:
        """The most blocks a buffer holding ``held`` may hold: those and what the budget leaves,
        within one allocation."""
        spare = self._spare()
        most = held + spare // self.shape.block_bytes if spare is not None else None
        bounds = [b for b in (most, self.largest) if b is not None]
        return min(bounds) if bounds else held + self.chunk

    def _grow(self, need: int) -> None:
        """Room for ``need`` blocks (:func:`~ov_kvcrush.gpu.growth.grow_blocks`), within :meth:`_most`."""
        most = self._most(self.capacity)
        if need > most:
            where = "the device's largest allocation" if most == self.largest else self.budget
            raise GPUPathError(
                f"the device pool is out of 2-bit blocks: {need} needed, {most} at most "
                f"({most * self.shape.block_bytes >> 20} MiB: {where}, the full-precision blocks' bytes beside them; "
                "a larger max_kv_blocks, scheduler_config.cache_size or --kv-pool-mib raises a budget)"
            )
        self.buffer, self.capacity = grow_blocks(self.dev, self.buffer, self._free, self.capacity, need, self.chunk,
                                                 most, self.shape.block_bytes)  # fmt: skip
