"""KVzip over the GPU plugin's pool: a scoring pass fed through the model, one threshold over every
layer and head (:mod:`ov_kvcrush.methods.kvzip`, the reference; the CPU op's ``kvzip.cpp``).

Between passes a sequence holds everything it is fed, as the full cache, and its heads keep
different counts once a pass has selected (the paper's one threshold over all heads): each head
has its own block table, count and positions, and the model's layers take each head's own
(``kvc_first`` and ``kvc_lengths`` are per row).

A step of the pass (:meth:`DeviceKVzipLayerCache.score_positions`, then the model's step) shows
the model, in each head, only what the reference's ``score_step`` attends: the sinks and the
chunk the step asks to repeat are gathered into blocks of their own (a scoring view), and the
step's tokens are stored after them there, so the model's own attention is the reference's over
that subsample. The model's attention also scores the view's slots (its ``OvkcRows``
layer: the largest probability a row of the step gives each slot, the rows' log-sum-exp and the
step's own keys as the model's attention had them); the view's blocks go back
to the pool and nothing of the step is kept. The sequence's selection, after the pass's last
step, reads each layer's scores back once (a prompt's pass, not a decode step) and ranks them
with the reference's :func:`~ov_kvcrush.methods.kvzip.select_kept`; the kept slots are then
gathered into fresh blocks on the device.

Departures: the 2-bit store (``quant``) is not served here. Nothing else: the torch path's
device pool (``paged_device``) does not run KVzip, since its scoring pass is the model's step
(the plugin's), not a layer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache
from ov_kvcrush.gpu.pool import DevicePool, table_array
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.gpu.store import launch_gather
from ov_kvcrush.methods.kvzip import KVzipConfig


@dataclass
class ScoringView:
    """A scoring step's layer as the model sees it: each head's held slots the step attends (its
    sinks and the chunk it repeats, ascending), which of them it scores (the chunk's), and, once
    :meth:`DeviceKVzipLayerCache.reserve` made it, the blocks they were gathered into with room
    for the step's ``tokens`` after them."""

    slots: list[np.ndarray]
    scored: list[np.ndarray]
    tables: list[list[int]]
    tokens: int = 0
    on_device: tuple[Any, int] | None = None

    @property
    def gathered(self) -> np.ndarray:
        """``[kv]``: each head's gathered slots."""
        return np.array([len(s) for s in self.slots], np.int32)


@dataclass
class StepScores:
    """A scoring step's scores on the device, read when the pass ends: ``largest`` ``[Hq,
    stride]`` each view slot's largest probability from a step's row, per query head."""

    largest: Any
    stride: int
    view: ScoringView


class DeviceKVzipLayerCache(DeviceFullLayerCache):
    """One layer of KVzip over the device pool, driven by the plugin's model steps: every token
    held until a scoring pass selects; each head its own count (:attr:`counts`), positions and
    scores on the host (:attr:`positions`, :attr:`score`: ``[kv, longest]``, ``-1`` and 0 past a
    head's count)."""

    sums_by_largest = True

    def __init__(self, config: KVzipConfig, pool: DevicePool, kv_heads: int, q_heads: int) -> None:
        super().__init__(pool, kv_heads, q_heads)
        self.config = config
        self.counts = np.zeros(kv_heads, np.int64)
        self.positions = np.zeros((kv_heads, 0), np.int64)
        self.score = np.zeros((kv_heads, 0), np.float32)
        #: the scoring step under way (None between a pass's steps and outside a pass)
        self.view: ScoringView | None = None
        self._step_scores: list[StepScores] = []

    # ---- what the plugin's step reads
    @property
    def in_prompt(self) -> bool:
        """A scoring step counts as the prompt's (it is part of compressing it)."""
        return self.view is not None or super().in_prompt

    def attends_own(self, t: int) -> bool:
        """A scoring step's tokens attend themselves exactly (the CPU op's scoring pass)."""
        return self.view is not None or super().attends_own(t)

    def model_slots(self) -> np.ndarray:
        if self.view is not None:
            return self.view.gathered + self.view.tokens
        return self.counts.astype(np.int32)

    def model_tables(self) -> list[list[int]]:
        return self.view.tables if self.view is not None else self.layer.tables

    def score_rows(self, t: int) -> int:
        """A scoring step's every row; none otherwise (a new token's score is 0 until a pass)."""
        return t if self.view is not None else 0

    def heads_held(self) -> np.ndarray:
        return self.counts

    def _metadata_bytes(self) -> int:
        return 4 * int(self.counts.sum())  # a score a slot

    # ---- holding tokens
    def reserve(self, t: int) -> None:
        """Room for a step's ``t`` tokens after each head's own slots; in a scoring step, the
        view's blocks (the held slots it attends gathered into them, room for the step's tokens)."""
        if self.view is not None:
            self._open_view(t)
            return
        self.layer.pool.phase = "prompt" if self.in_prompt else "decode"
        first = self.counts.copy()
        self._resize(first + t)
        for h in range(self.layer.kv_heads):
            self.positions[h, first[h] : first[h] + t] = np.arange(self.seen, self.seen + t)
        self.seen += t

    def _resize(self, counts: np.ndarray) -> None:
        """Each head to hold ``counts[h]`` slots: blocks allocated or given back, the host's
        positions and scores widened (new slots: position -1, score 0) or cut."""
        lay = self.layer
        lay.fit_heads(counts)
        width = lay.held
        keep = min(width, self.positions.shape[1])
        positions = np.full((lay.kv_heads, width), -1, np.int64)
        score = np.zeros((lay.kv_heads, width), np.float32)
        positions[:, :keep], score[:, :keep] = self.positions[:, :keep], self.score[:, :keep]
        for h in range(lay.kv_heads):
            positions[h, counts[h] :] = -1
            score[h, counts[h] :] = 0.0
        self.positions, self.score, self.counts = positions, score, counts.astype(np.int64)

    def truncate(self, tokens: int) -> bool:
        """Forget every token at position ``tokens`` or later in each head (its slots ascend in
        position: a head keeps its first ones), the kept ones' scores with them."""
        self._resize(((self.positions >= 0) & (self.positions < tokens)).sum(axis=1))
        self.seen = min(self.seen, tokens)
        return True

    def release(self) -> None:
        self.end_scoring_pass(keep_scores=False)
        super().release()
        self._resize(np.zeros(self.layer.kv_heads, np.int64))

    # ---- the scoring pass
    @staticmethod
    def view_room(config: KVzipConfig, step: int) -> int:
        """The most slots a head's view gathers for a scoring step of ``step`` tokens: the chunk
        it repeats (among the step's tokens) and the sinks."""
        return step + config.sink_tokens

    def score_positions(self, lo: int, hi: int) -> None:
        """The next step is a scoring step that repeats the tokens at positions ``[lo, hi)``: it
        attends them and the sinks (positions before ``min(sink_tokens, lo)``), and scores them."""
        self._close_view()
        pos = self.positions
        chunk = (pos >= lo) & (pos < hi)
        attended = chunk | ((pos >= 0) & (pos < min(self.config.sink_tokens, lo)))
        heads = range(self.layer.kv_heads)
        self.view = ScoringView([np.flatnonzero(attended[h]) for h in heads],
                                [chunk[h][attended[h]] for h in heads], [])  # fmt: skip

    def _open_view(self, t: int) -> None:
        """The view's blocks: its slots gathered into them on the device, room for ``t`` tokens."""
        view, lay = self.view, self.layer
        assert view is not None and not view.tables, "a scoring step's view is made once"
        p, bs = lay.pool, lay.pool.shape.block_size
        p.phase = "prompt"
        view.tokens = t
        counts = view.gathered
        view.tables = [p.allocate(-(-(int(n) + t) // bs)) for n in counts]
        array = table_array(view.tables)
        view.on_device = (p.upload("block tables", array), array.shape[1])
        self._gather(view.slots, *view.on_device)

    def _gather(self, slots: list[np.ndarray], tables: Any, stride: int) -> None:
        """Each head's held ``slots`` copied, in order, to slots ``0 ..`` of the blocks of ``tables``."""
        lay, p = self.layer, self.layer.pool
        width = max((len(s) for s in slots), default=0)
        if not width:
            return
        src = p.upload("kept slots", table_array(slots))
        counts = p.upload("kept counts", np.array([len(s) for s in slots], np.int32))
        old, old_stride = lay.device_tables()
        launch_gather(p.dev, p.shape, p.buffer, old, old_stride, tables, stride, src, width, counts, lay.kv_heads)

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """After a scoring step: the view's slots' scores, each the largest probability a row of
        the step gives it under the step's own softmax, as the model's attention gave them
        (``sums`` ``[Hq, view slots]``, kept until the pass ends); the view's blocks go back to
        the pool. Any other step: nothing (a new token's score is 0)."""
        view = self.view
        if view is None:
            return
        if sums is None:
            raise RuntimeError("kvzip: the model's scoring step gave no window sums")
        lay, p = self.layer, self.layer.pool
        stride = int(view.gathered.max()) + t
        largest = p.dev.empty(4 * lay.q_heads * stride)  # the step's buffer is the next step's too
        p.dev.copy_bytes(sums, largest, 4 * lay.q_heads * stride, 0)
        self._step_scores.append(StepScores(largest, stride, view))
        self._close_view()

    def _close_view(self) -> None:
        """The view's blocks back to the pool (the kernels queued over them run first)."""
        if self.view is not None:
            for table in self.view.tables:
                self.layer.pool.release(table)
            self.view = None

    def end_scoring_pass(self, keep_scores: bool = True) -> None:
        """The pass is over: its scores read back and kept where larger (each scored slot's
        largest probability over its KV head's query heads; ``keep_scores`` False: dropped, a
        pass that failed), the view closed."""
        self._close_view()
        if not keep_scores:
            self._step_scores = []
        p, lay = self.layer.pool, self.layer
        group = lay.q_heads // lay.kv_heads
        for step in self._step_scores:
            largest = p.download("kvzip scores", step.largest, np.float32, (lay.q_heads, step.stride))
            best = largest.reshape(lay.kv_heads, group, step.stride).max(axis=1)
            for h, (slots, scored) in enumerate(zip(step.view.slots, step.view.scored, strict=True)):
                held = slots[scored]
                self.score[h, held] = np.maximum(self.score[h, held], best[h, : len(slots)][scored])
        self._step_scores = []

    def selection_scores(self) -> torch.Tensor:
        """``[1, kv, longest]`` what the selection ranks (the reference's): the scores, ``+inf``
        for each head's sinks and recent window, ``-inf`` past its count."""
        pos, cfg = self.positions, self.config
        held = pos >= 0
        rank = np.arange(pos.shape[1])[None, :]
        recent = rank >= self.counts[:, None] - cfg.recent_tokens
        protected = held & ((pos < cfg.sink_tokens) | recent)
        s = np.where(held, self.score, -np.inf)
        return torch.from_numpy(np.where(protected, np.inf, s).astype(np.float32))[None]

    def keep_mask(self, keep: np.ndarray) -> None:
        """Keep the slots marked in ``keep`` ``[kv, longest]`` (in slot order, each head its own
        count): gathered into fresh blocks on the device, their positions and scores with them."""
        lay, p, bs = self.layer, self.layer.pool, self.layer.pool.shape.block_size
        kept = [np.flatnonzero(keep[h, : self.counts[h]]) for h in range(lay.kv_heads)]
        tables = [p.allocate(-(-len(k) // bs)) for k in kept]
        array = table_array(tables)
        on_device = (p.upload("block tables", array), array.shape[1])
        self._gather(kept, *on_device)
        for table in lay.tables:
            p.release(table)
        lay.set_tables(tables, on_device)
        counts = np.array([len(k) for k in kept], np.int64)
        width = int(counts.max()) if counts.size else 0
        positions = np.full((lay.kv_heads, width), -1, np.int64)
        score = np.zeros((lay.kv_heads, width), np.float32)
        for h, k in enumerate(kept):
            positions[h, : len(k)], score[h, : len(k)] = self.positions[h, k], self.score[h, k]
        evicted = int(self.counts.sum() - counts.sum())
        self.positions, self.score, self.counts, lay.held = positions, score, counts, width
        self._bump("evicted", float(evicted))
