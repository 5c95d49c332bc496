"""How the GPU path's buffers of blocks grow (the pool's full-precision blocks,
:class:`~ov_kvcrush.gpu.pool.DevicePool`, and the 2-bit store's,
:class:`~ov_kvcrush.gpu.quant_blocks.QuantBlocks`): by a chunk or a tenth of what they hold,
whichever is more, so a buffer holds at most 1.1 times the blocks in use plus a chunk; the held
blocks copied over on the device (a block taken is written whole, so nothing is filled)."""

from __future__ import annotations

from typing import Any

from ov_kvcrush.gpu.device import KernelDevice


def grow_blocks(
    dev: KernelDevice, buffer: Any, free: list[int], held: int, need: int, chunk: int, most: int, block_bytes: int
) -> tuple[Any, int]:
    """A buffer of ``held`` blocks grown to hold ``need`` (``need <= most``): a chunk more or a
    tenth more, at least ``need``, at most ``most``. The new blocks' ids go first in ``free`` (its
    end is taken first). Returns the new buffer and its blocks."""
    new = min(most, max(need, held + max(chunk, held // 10)))
    grown = dev.empty(new * block_bytes)
    dev.copy_bytes(buffer, grown, held * block_bytes, 0)
    free[:0] = range(new - 1, held - 1, -1)
    return grown, new
