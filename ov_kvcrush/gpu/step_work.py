"""A decode step's method work for every sequence of the step, one launch per kernel (the GPU
plugin's model, issue 71: at most 6 commands a layer for any method, however many sequences).

After the model's step each layer cache says what its sequence's decode work is, as a
:class:`StepWork` (the host's bookkeeping done: the slot counts, the positions' host copy),
instead of launching it; :func:`launch_step_work` then packs a row of :data:`WORK_FIELDS` ints
per sequence and launches each kernel once over the layer's sequences (``paged_store.cl``'s
``step_*``: the one-sequence kernels' bodies, each work-group reading its sequence's row). Each
sequence's scores and positions lie in the pool's arena (:class:`~ov_kvcrush.gpu.arena.SlotState`,
their word offsets in the row); the block tables are the step's, as the model read them.

The 2-bit store's work (a flush's scores in the store's order; an eviction of whole chunks under
a selection not frozen) is the last launch, over the sequences that have it
(``step_quant_store``: :mod:`~ov_kvcrush.gpu.quant_step`). A cache whose
step is not such work (a prompt) returns None and does its work itself, as before
(:meth:`~ov_kvcrush.gpu.layer_cache.DeviceFullLayerCache.after_model_step`). KVCrush's
selection anew drops one unit a decode step (the token past the budget, or a block's worth): the
step's selections are one launch over its sequences (``kvcrush.cl``'s ``step_kvcrush_drop``),
after their probabilities are added and before the drop; a selection of more (none in a decode
step) is its sequence's own work after the launches (:attr:`StepWork.then`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, Protocol

import numpy as np

from ov_kvcrush.gpu.arena import SlotState
from ov_kvcrush.gpu.clusterkv import StepClustering, launch_step_clusterings
from ov_kvcrush.gpu.device import kernel_defines
from ov_kvcrush.gpu.kvcrush import StepSelection, launch_step_selections
from ov_kvcrush.gpu.pool import DevicePool, PagedLayer
from ov_kvcrush.gpu.quant_blocks import QuantBlocks
from ov_kvcrush.gpu.quant_step import ChunkEviction, QuantStepBuffers, QuantStepRow, launch_quant_steps
from ov_kvcrush.gpu.store import store_constants

#: the kernels' source, whose ``#define``s lay out a row (the one copy of that layout)
SOURCE = "paged_store.cl"


@cache
def row_layout() -> tuple[int, dict[str, int], dict[str, int]]:
    """A row as ``paged_store.cl`` reads it: its ints (``WORK_FIELDS``), each field's place
    (``W_<FIELD>``: :class:`StepWork`'s field ``<field>``, and ``logit_row``) and the drops'
    codes (``DROP_NONE``, ``DROP_LOWEST``, ``DROP_SELECTED``)."""
    defines = kernel_defines(SOURCE)
    places = {name[2:].lower(): at for name, at in defines.items() if name.startswith("W_")}
    return defines["WORK_FIELDS"], places, {k: defines[k] for k in ("DROP_NONE", "DROP_LOWEST", "DROP_SELECTED")}


#: a row's ints
WORK_FIELDS = row_layout()[0]
#: :attr:`StepWork.drop`: no slot dropped; the lowest middle slot (H2O's rank rule); the unit a
#: selection anew does not keep (KVCrush's: :attr:`StepWork.selection`)
DROP_NONE, DROP_LOWEST, DROP_SELECTED = (row_layout()[2][k] for k in ("DROP_NONE", "DROP_LOWEST", "DROP_SELECTED"))


@dataclass
class StepWork:
    """One sequence's decode-step method work in one layer: add the step's probabilities to its
    scores (over ``scored`` slots, the ones from ``add_from`` new), score the slots from
    ``norms_from`` by their keys' norms (Knorm), drop one slot a head (``drop``: a slot, or
    :data:`DROP_LOWEST` of the ``mid`` slots after ``sinks``) of the ``held`` ones, and after a
    2-bit flush put the scores in the store's new order (:meth:`flushed`). ``-1``: not this part.
    Where the scores grew before the step (``grown``: where they were, rows ``grown_stride``
    apart), the adding reads the held ones there: the copy is that launch's. ``then``: the
    sequence's own work after the launches, which reads what they wrote (a selection anew over the
    scores with the step's probabilities added: KVCrush's), where it is not one unit dropped
    (``selection``: launched with the step's others, :meth:`drop_selected`)."""

    layer: PagedLayer
    scores: SlotState | None = None
    score_stride: int = 0
    add_from: int = -1
    scored: int = 0
    norms_from: int = -1
    drop: int = DROP_NONE
    sinks: int = 0
    mid: int = 0
    held: int = 0
    positions: SlotState | None = None
    pos_stride: int = 0
    fresh: int = 0
    fresh_position: int = 0
    flush_from: int = -1
    flush_pinned: int = 0
    flush_count: int = 0
    #: the slots dropped from ``drop`` (1, or a flushed chunk's), and whether their scores go too
    drop_count: int = 1
    drop_scores: int = 1
    grown: SlotState | None = None
    grown_stride: int = 0
    then: Callable[[], None] | None = None
    selection: StepSelection | None = None
    #: the 2-bit store's work after the launch's other kernels (:meth:`quant_store`): its 2-bit
    #: and full-precision slots (None: none), the chunks it evicts, whether ranked by the layer
    quant_slots: tuple[int, int] | None = None
    chunks: ChunkEviction | None = None
    chunks_by_layer: bool = False

    def flushed(self, first: int, pinned: int, count: int) -> None:
        """The model flushed the ``count`` full-precision slots after the ``pinned`` ones into the
        2-bit store: their scores, from score ``first`` on, go before the pinned slots' (the
        store's order; those of the slots after them stay), the step's token's (the last held)
        from zero."""
        self.flush_from, self.flush_pinned, self.flush_count = first, pinned, count

    def drop_one(self, drop: int, sinks: int = 0, mid: int = 0, host_dropped: np.ndarray | None = None) -> None:
        """Drop slot ``drop`` (or :data:`DROP_LOWEST`) of every head in the launch; the layer's
        host side now (:meth:`PagedLayer.forget_one`; its empty blocks go after the launch)."""
        lay = self.layer
        self.drop, self.sinks, self.mid, self.held = drop, sinks, mid, lay.held
        self.positions, self.pos_stride, self.fresh, self.fresh_position = lay.slot_positions.drop_fields()
        lay.forget_one(host_dropped)

    def drop_selected(self, selection: StepSelection) -> None:
        """Drop the unit ``selection`` does not keep (its ``block`` slots a head, found on the
        device after the step's probabilities are added); the layer's host side now."""
        lay, count = self.layer, selection.fields.block
        self.selection, self.drop, self.drop_count, self.held = selection, DROP_SELECTED, count, lay.held
        self.positions, self.pos_stride, self.fresh, self.fresh_position = lay.slot_positions.drop_fields()
        lay.forget_one(count=count)

    def drop_flushed(self, first: int, count: int) -> None:
        """The full-precision slots ``first .. first + count`` of every head (a chunk the model
        flushed into the 2-bit store) gone, the slots after them moved down, their scores left to
        :meth:`flushed`'s order; the layer's host side now."""
        lay = self.layer
        self.drop, self.drop_count, self.drop_scores, self.held = first, count, 0, lay.held
        self.positions, self.pos_stride, self.fresh, self.fresh_position = lay.slot_positions.drop_fields()
        lay.forget_run(first, count)

    def quant_store(self, quantized: int, held: int, eviction: ChunkEviction | None, by_layer: bool) -> None:
        """After the launch's other kernels, the 2-bit store's work over its ``quantized`` 2-bit
        slots and ``held`` full-precision ones (after the step's flush): the flush's scores into
        the store's order (where :meth:`flushed` said), then ``eviction``'s whole chunks dropped,
        chosen on the device by the scores the launch left (``by_layer``: every head by the
        layer's summed scores); the host's side is the cache's."""
        self.quant_slots, self.chunks, self.chunks_by_layer = (quantized, held), eviction, by_layer

    def row(self, logit_row: int) -> list[int]:
        """The ints ``paged_store.cl`` reads (``logit_row``: the sequence's among the step's logits)."""
        grown = _offset(self.grown) if self.grown is not None else -1
        return _row(vars(self) | {"scores": _offset(self.scores), "positions": _offset(self.positions),
                                  "grown": grown, "logit_row": logit_row})  # fmt: skip


def _row(values: dict[str, Any]) -> list[int]:
    """``values`` at their places in a row (:func:`row_layout`), the rest 0."""
    _, places, _ = row_layout()
    out = [0] * WORK_FIELDS
    for name, at in places.items():
        out[at] = int(values[name])
    return out


def _offset(state: SlotState | None) -> int:
    if state is None:
        return 0
    if state.offset is None:
        raise AssertionError("a step's work lies in the pool's arena (a cache offers it only there)")
    return state.offset


@dataclass(frozen=True)
class StepTables:
    """The step's block tables on the device (the model's ``kvc_tables``, ``[layers, sequences *
    kv, stride]``), how many rows a layer has and how many KV heads a sequence (a step shown at a
    padded size has more rows than its sequences': :mod:`~ov_kvcrush.gpu.step_shape`); over the
    2-bit store its tables too (``kvc_qtables``, the same rows, ``quant_stride`` wide) and blocks."""

    buffer: Any
    rows_per_layer: int
    stride: int
    kv_heads: int
    quant: Any = None
    quant_stride: int = 0
    quant_blocks: QuantBlocks | None = None

    def quant_row(self, layer: int, sequence: int) -> int:
        """The first word of ``sequence``'s first KV head's 2-bit table in ``layer``."""
        return (layer * self.rows_per_layer + sequence * self.kv_heads) * self.quant_stride


@dataclass(frozen=True)
class StepLogitRows:
    """A layer's decode rows' logits as the model wrote them (:class:`~ov_kvcrush.gpu.slots.StepLogits`'
    layout: ``rows`` rows of ``stride``)."""

    buffer: Any
    stride: int
    rows: int


def launch_step_work(
    pool: DevicePool, layer: int, works: list[StepWork | None], tables: StepTables, logits: StepLogitRows | None,
    group: int,
) -> None:  # fmt: skip
    """Layer ``layer``'s work of the step's sequences (``works[s]``: sequence ``s``'s, None where
    it has none here): each kernel launched once, over every sequence, where any needs it; then
    the blocks a drop emptied go back to the pool, and each sequence's own work after them
    (:attr:`StepWork.then`)."""
    todo = [w for w in works if w is not None]
    if not todo:
        return
    dev, shape, i32 = pool.dev, pool.shape, np.int32
    assert pool.slot_arena is not None
    arena = pool.slot_arena.buffer
    rows = np.array([w.row(s) if w else _NOTHING for s, w in enumerate(works)], np.int32)
    work = pool.upload("step work", rows)
    seqs, kv = len(works), tables.kv_heads
    first = layer * tables.rows_per_layer
    constants = store_constants(shape)

    def kernel(name: str) -> Any:
        return dev.kernel("paged_store.cl", name, constants)

    norms = max((w.held - w.norms_from for w in todo if w.norms_from >= 0), default=0)
    if norms:
        dev.run(kernel("step_key_norms"), (norms, kv, seqs), None, pool.buffer, tables.buffer, i32(first),
                i32(tables.stride), i32(group), arena, work)  # fmt: skip
    scored = max((w.scored for w in todo if w.add_from >= 0), default=0)
    if scored:
        assert logits is not None, "a step's probabilities come from its logits"
        dev.run(kernel("step_add_logits"), (scored, kv * group, seqs), None, arena, work, logits.buffer,
                i32(logits.stride), i32(logits.rows))  # fmt: skip
    if any(w.drop != DROP_NONE for w in todo):
        dropped = dev.empty(4 * seqs * kv)
        if any(w.drop == DROP_LOWEST for w in todo):
            sg = dev.sub_group
            dev.run(kernel("step_drop_lowest"), (sg, kv, seqs), (sg, 1, 1), arena, work, i32(group), dropped)
        if any(w.selection is not None for w in todo):
            selections = [(w.selection, _offset(w.scores), w.score_stride) if w and w.selection else None
                          for w in works]  # fmt: skip
            launch_step_selections(dev, pool, arena, selections, kv, dropped)
        dev.run(kernel("step_drop_slot"), (shape.head_dim + 5 + group, kv, seqs), None, pool.buffer, tables.buffer,
                i32(first), i32(tables.stride), arena, work, dropped, i32(group))  # fmt: skip
    if any(w.quant_slots is not None for w in todo):  # a flush's scores, a chunk eviction: after the others
        _launch_quant_steps(pool, layer, works, tables, arena, group)
    for w in todo:
        if w.drop != DROP_NONE:
            w.layer.release_empty_blocks()
        if w.then is not None:
            w.then()


def _launch_quant_steps(
    pool: DevicePool, layer: int, works: list[StepWork | None], tables: StepTables, arena: Any, group: int
) -> None:  # fmt: skip
    """The step's 2-bit store work in ``layer``, one launch over the sequences that have it."""
    blocks = tables.quant_blocks
    assert blocks is not None and tables.quant is not None, "a step over the 2-bit store has its tables"
    rows = []
    for s, w in enumerate(works):
        if w is None or w.quant_slots is None:
            continue
        flush = (w.flush_from, w.flush_pinned, w.flush_count) if w.flush_from >= 0 else None
        rows.append(QuantStepRow(_offset(w.scores), w.score_stride, *w.quant_slots, flush, w.chunks,
                                 tables.quant_row(layer, s), tables.quant_stride, w.chunks_by_layer))  # fmt: skip
    buffers = QuantStepBuffers(arena, tables.quant, blocks.buffer, blocks.shape, tables.kv_heads, group)
    launch_quant_steps(pool, buffers, rows)


class ClusteringLayer(Protocol):
    """A sequence's layer cache as :func:`launch_layer_clusterings` asks it."""

    def take_step_clustering(self) -> StepClustering | None: ...

    def clustering_enqueued(self, due: StepClustering, iterations: tuple[Any, int]) -> None: ...


def launch_layer_clusterings(pool: DevicePool, layer: int, caches: list[ClusteringLayer], tables: StepTables) -> None:
    """Layer ``layer``'s clusterings due before the model's step (``caches[s]``: sequence ``s``'s
    cache there), one launch over the step's sequences, their keys read through the step's block
    tables; enqueued before the model's step, whose recall reads the clusters they add."""
    due = [c.take_step_clustering() for c in caches]
    if not any(due):
        return
    heads = (pool.buffer, tables.buffer, layer * tables.rows_per_layer, tables.stride)
    iterations = launch_step_clusterings(pool.dev, pool, pool.shape, heads, pool.index_arena().buffer, due)
    for s, (layer_cache, clustering) in enumerate(zip(caches, due, strict=True)):
        if clustering is not None:
            layer_cache.clustering_enqueued(clustering, (iterations, s * tables.kv_heads))


#: the row of a sequence with no work in the layer: every field's default
_NOTHING = _row(
    {f.name: f.default for f in fields(StepWork) if f.default is not MISSING}
    | {"scores": 0, "positions": 0, "grown": -1, "logit_row": 0}
)
