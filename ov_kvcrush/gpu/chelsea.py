"""Chelsea's merge on the GPU path (``plugins/gpu/kernels/chelsea.h``): a cache row's tokens merged
down to the budget in place, in the pool, with their degrees and protect scores, as the reference's
:func:`~ov_kvcrush.methods.chelsea.chelsea_compress` does it (the CPU op's ``chelsea.cpp`` port, step
for step).

A row is one sequence's KV head in one layer. Its :data:`MERGE_FIELDS` say what it holds and
where its state is: the degrees (each slot's count of tokens merged into it) and protect scores
lie in runs of an :class:`~ov_kvcrush.gpu.arena.IndexArena`'s words, which the GPU plugin's model
reads (its merge layer, and its prompt layer's ``log(degree)`` bias). The host kernel here
(``chelsea.cl``) merges a prompt after it was attended; the model's merge layer
(``plugin_layers.cl``'s ``ovkc_merge``) merges a decode step's rows before they are attended.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import KernelDevice, device
from ov_kvcrush.gpu.layout import PoolShape, check_tables
from ov_kvcrush.gpu.store import store_constants

#: a row's ``merge`` fields, in order (``chelsea.h``'s M_* defines): the slots held before the
#: merge (0: the row does not merge now), after it, the words of the row's degrees and of its
#: protect scores (-1: none), the slots those runs hold, the word of its working words in the
#: scratch buffer, and the method's settings (:meth:`~ov_kvcrush.methods.chelsea.ChelseaConfig.op_fields`'s)
MERGE_FIELDS = (
    "held", "target", "degrees", "scores", "capacity", "scratch", "sinks", "recent", "chunk", "protect",
    "ratio_e4", "decay_e4", "decay_steps", "value_aware",
)  # fmt: skip
MERGE_WIDTH = len(MERGE_FIELDS)
#: the fields a method's settings fill, from ``settings`` (:func:`method_fields`)
SETTINGS = MERGE_FIELDS[6:]


def merge_scratch_words(held: int) -> int:
    """The int32 words a row of ``held`` slots works in (``chelsea.h``'s MERGE_SCRATCH_WORDS)."""
    return 7 * held + 8


def method_fields(fields: dict[str, object]) -> np.ndarray:
    """The settings part of a row's fields (:data:`SETTINGS`) from a Chelsea config's
    ``op_fields`` (its ``link_score`` as ``value_aware``)."""
    values = dict(fields, value_aware=int(fields["link_score"] == "key_value"))
    return np.array([int(values[name]) for name in SETTINGS], np.int32)  # type: ignore[call-overload]


def launch_merge_rows(
    dev: KernelDevice,
    shape: PoolShape,
    pool: Any,
    tables: Any,
    table_width: int,
    index: Any,
    merge: Any,
    rows: int,
    scratch: Any,
    scores: tuple[Any, int, int] | None,
) -> None:
    """Enqueue the merge of ``rows`` rows (device ``merge`` ``[rows, MERGE_WIDTH]`` int32; the
    rows' blocks device ``tables`` ``[rows, table_width]``) in device ``pool``, their degrees
    starting at 1, their protect scores ``scores`` ``(buffer, rows summed, stride)``: row ``r``'s
    are the sum of the buffer's rows ``r * summed ..``, ``stride`` floats apart (None: none);
    their degrees and scores into their runs of ``index``; ``scratch`` holds each row's words at
    its ``scratch`` field."""
    kernel = dev.kernel("chelsea.cl", "merge_rows", store_constants(shape))
    buffer, summed, stride = scores if scores is not None else (scratch, 0, 0)
    i32, sg = np.int32, dev.sub_group
    dev.run(kernel, (sg, rows), (sg, 1), pool, tables, i32(table_width), index, merge, scratch, buffer, i32(summed),
            i32(stride))  # fmt: skip


def merge_rows(
    shape: PoolShape,
    pool: np.ndarray,
    tables: np.ndarray,
    fields: np.ndarray,
    scores: np.ndarray | None = None,
    sub_group: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge each row of ``fields`` ``[rows, MERGE_WIDTH]`` (its blocks a row of ``tables``) in
    the pool, its protect scores the sum of ``scores`` ``[rows, summed, n]``'s rows; returns the
    pool and the words of the runs (``degrees``, ``scores`` fields: word offsets into them)."""
    rows = fields.shape[0]
    held = fields[:, MERGE_FIELDS.index("held")]
    check_tables("tables", tables, held.astype(np.int64), shape.block_size, pool.nbytes, shape.block_bytes)
    capacity = fields[:, MERGE_FIELDS.index("capacity")]
    runs = [fields[:, MERGE_FIELDS.index(name)] for name in ("degrees", "scores")]
    words = max(1, max(int(r.max()) + int(capacity.max()) for r in runs))
    dev = device(sub_group)
    fields = fields.astype(np.int32).copy()
    per_row = merge_scratch_words(int(held.max()))
    fields[:, MERGE_FIELDS.index("scratch")] = np.arange(rows) * per_row
    pool_b = dev.to_device(pool.view(np.uint8))
    index = dev.to_device(np.zeros(words, np.float32))
    scratch = dev.to_device(np.zeros(rows * per_row, np.int32))
    scores_on = None
    if scores is not None:
        scores_on = (dev.to_device(scores.astype(np.float32)), scores.shape[1], scores.shape[2])
    launch_merge_rows(dev, shape, pool_b, dev.to_device(tables.astype(np.int32)), tables.shape[1], index,
                      dev.to_device(fields), rows, scratch, scores_on)  # fmt: skip
    return dev.to_host(pool_b, np.uint8, (pool.nbytes,)), dev.to_host(index, np.float32, (words,))
