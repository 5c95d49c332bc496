"""The 2-bit store's work after the others of a decode step on the GPU path's device: a flush's
scores into the store's order, and the eviction of whole chunks, nothing read back (issue 71: at
most one blocking host wait and six commands a layer a decode step, whatever the method). One
launch over the step's sequences (``paged_store.cl``'s ``step_quant_store``, a work-group a row).

The reference (:meth:`~ov_kvcrush.methods.importance.ImportanceLayerCache._evict_quantized_chunks`,
SnapKV or H2O with ``quant``) drops, per KV head, its lowest-scoring whole chunks while the head
keeps its budget; a chunk holding a sink or a recent token stays, and every head drops as many.
Its two halves split along what each side knows:

* **The host counts** (:func:`plan_chunk_eviction`): how many chunks each head drops, and which of
  its chunks may go. Those are a run: a head's 2-bit slots are in position order (the prompt's
  kept tokens, then each flushed residual), so its sink chunks are its first and its recent ones
  its last. The host knows each chunk's positions until an eviction chooses among the middle
  ones on the device; after it, the middle is :data:`UNKNOWN`, which is no loss, since a chunk
  once in the middle is never a sink nor recent again (the recent window only moves on).
* **The device chooses and moves**: it ranks the chunks that may go by their scores' sums and
  moves the kept chunks' 2-bit blocks and scores down in place, so each head's first blocks hold
  its kept chunks and its last ``drop`` blocks come free: the host gives those back without
  learning which chunks went.

Before, the chunks' sums came to the host to be ranked there: a blocking read and four launches
a sequence that evicted (5 waits in such a step of four sequences), and a flush's scores were
the drop launch's, a command more in a step in which one sequence flushed and another evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import kernel_defines
from ov_kvcrush.gpu.layout import QuantShape
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.store import store_constants

#: a chunk's token position the host no longer knows (one an eviction may have moved: a middle one)
UNKNOWN = -1
#: the kernel's work-group: a row's chunks ranked and moved by these work-items together
LOCAL_SIZE = 64


@cache
def row_fields() -> tuple[int, dict[str, int]]:
    """A row as ``paged_store.cl`` reads it: its fixed ints (``QUANT_STEP_FIELDS``) and each one's
    place (``Q_<NAME>``)."""
    defines = kernel_defines("paged_store.cl")
    return defines["QUANT_STEP_FIELDS"], {name[2:]: at for name, at in defines.items() if name.startswith("Q_")}


@dataclass(frozen=True)
class ChunkEviction:
    """What one sequence's layer drops: ``drop`` chunks of every KV head, each among its chunks
    ``ranges[h, 0] .. ranges[h, 1]`` (the others hold a sink or a recent token)."""

    drop: int
    ranges: np.ndarray


def plan_chunk_eviction(
    qpos: np.ndarray, chunk: int, over: int, sink_tokens: int, last_old: int
) -> ChunkEviction | None:
    """The eviction of ``over`` chunks a head (fewer where a head has fewer that may go), given
    the 2-bit slots' positions ``qpos`` ``[kv, chunks * chunk]`` (:data:`UNKNOWN` where an
    eviction chose); a chunk holding a position below ``sink_tokens`` or after ``last_old``
    stays (:func:`~ov_kvcrush.methods.selection.keep_chunk_indices`' rule). None: nothing goes."""
    kv, slots = qpos.shape
    chunks = slots // chunk
    if over <= 0 or chunks == 0:
        return None
    pos = qpos.reshape(kv, chunks, chunk)
    known = (pos != UNKNOWN).all(-1)
    stays = known & ((pos < sink_tokens).any(-1) | (pos > last_old).any(-1))
    ranges = np.zeros((kv, 2), np.int32)
    for h in range(kv):
        may_go = np.flatnonzero(~stays[h])
        first, end = (int(may_go[0]), int(may_go[-1]) + 1) if may_go.size else (chunks, chunks)
        if stays[h, first:end].any():
            raise AssertionError(f"head {h}'s chunks that stay are not its first and last ones: {stays[h].tolist()}")
        ranges[h] = first, end
    drop = min(over, int((ranges[:, 1] - ranges[:, 0]).min()))
    return ChunkEviction(drop, ranges) if drop > 0 else None


def positions_after(qpos: np.ndarray, chunk: int, eviction: ChunkEviction) -> np.ndarray:
    """The 2-bit slots' positions after ``eviction``: each head's chunks that stayed as they were,
    the middle's kept ones :data:`UNKNOWN` (the device chose them)."""
    kv = qpos.shape[0]
    out = []
    for h in range(kv):
        first, end = (int(x) * chunk for x in eviction.ranges[h])
        kept = end - first - eviction.drop * chunk
        out.append(np.concatenate([qpos[h, :first], np.full(kept, UNKNOWN, qpos.dtype), qpos[h, end:]]))
    return np.stack(out)


@dataclass(frozen=True)
class QuantStepRow:
    """One sequence's layer's 2-bit store work as a row of the launch, over its scores
    (``score_offset``: their first word in the launch's arena, a query head's row ``score_stride``
    words on), its ``quantized`` 2-bit slots then ``held`` full-precision ones (after the step's
    flush): the flush's scores into the store's order (``flush``: the first full-precision score
    before it, the pinned slots before the chunk, the chunk's slots), then ``eviction``, its heads'
    2-bit block ids from word ``table`` of the launch's tables (a head's row ``table_stride`` on;
    ``layer_scope``: every head ranks by the layer's summed sums)."""

    score_offset: int
    score_stride: int
    quantized: int
    held: int
    flush: tuple[int, int, int] | None = None
    eviction: ChunkEviction | None = None
    table: int = 0
    table_stride: int = 0
    layer_scope: bool = False

    def ints(self, kv: int) -> list[int]:
        width, places = row_fields()
        flush_from, pinned, count = self.flush or (-1, 0, 0)
        values = {"SCORES": self.score_offset, "SCORE_STRIDE": self.score_stride, "QUANTIZED": self.quantized,
                  "HELD": self.held, "DROP": self.eviction.drop if self.eviction else 0,
                  "LAYER_SCOPE": int(self.layer_scope), "TABLE": self.table, "TABLE_STRIDE": self.table_stride,
                  "FLUSH_FROM": flush_from, "FLUSH_PINNED": pinned, "FLUSH_COUNT": count}  # fmt: skip
        row = [0] * width
        for name, at in places.items():
            row[at] = int(values[name])
        ranges = self.eviction.ranges if self.eviction else np.zeros((kv, 2), np.int32)
        return row + [int(x) for x in ranges.ravel()]


@dataclass(frozen=True)
class QuantStepBuffers:
    """What a launch reads besides its rows: the arena of the rows' scores, the 2-bit block tables
    and blocks (``shape``'s), and how many query heads a KV head has."""

    arena: Any
    tables: Any
    blocks: Any
    shape: QuantShape
    kv: int
    group: int


def launch_quant_steps(pool: DevicePool, buffers: QuantStepBuffers, rows: list[QuantStepRow]) -> None:
    """Enqueue ``rows``' work, one launch (their rows uploaded, counted by ``pool``)."""
    if not rows:
        return
    dev, shape, kv = pool.dev, buffers.shape, buffers.kv
    max_chunks = max(r.quantized // shape.block_size for r in rows)
    packed = pool.upload("2-bit store work", np.array([r.ints(kv) for r in rows], np.int32))
    scratch = dev.empty(4 * len(rows) * (2 * kv + 1) * max(max_chunks, 1))
    i32 = np.int32
    kernel = dev.kernel("paged_store.cl", "step_quant_store", store_constants(pool.shape))
    dev.run(kernel, (LOCAL_SIZE, len(rows)), (LOCAL_SIZE, 1), buffers.arena, packed, i32(kv), i32(buffers.group),
            i32(shape.block_size), i32(shape.block_bytes // 4), i32(max_chunks), buffers.tables, buffers.blocks,
            scratch)  # fmt: skip
