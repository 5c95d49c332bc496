"""Chelsea over the GPU plugin's pool: chunked soft matching and degree-weighted merges on the
device, ``log(degree)`` in the model's attention (:mod:`ov_kvcrush.methods.chelsea`, the
reference; the CPU op's ``chelsea.cpp``).

The reference's order is kept. A prompt is attended whole (in chunks, if fed so), then merged:
after the model's step that ends it, one launch merges the layer's heads (``chelsea.cl``, from
the prompt window's scores where ``protect_tokens`` asks). A decode step appends its token,
merges a head that reaches the budget plus the merge interval, then attends: the model's own
merge layer does it between its store and its attention (``OvkcMerge``), so that the step's
attention sees the merged head, its slots' degrees added to their logits (``OvkcMergePrefill``).
What a merge keeps is the device's to know: no host wait and nothing read back. The host knows
only how many (the budget: the passes' sizes depend on sizes alone).

Each merged head's degrees and protect scores lie in the pool's :class:`~ov_kvcrush.gpu.arena.IndexArena`
words (the model's ``kvc_index``), room for the budget plus the merge interval. Outlier heads
are never merged and keep every token: the heads of a layer keep different counts, each its own
block table (the model's ``kvc_first``/``kvc_lengths`` are per row).

Departures: on the plugin's sequences only (the torch path's ``paged_device`` does not run it:
its merge is the model's layer); not over the 2-bit store (as the CPU op). A merge's second and
later passes read the tokens the first merged as the store holds them (f16 or u8 rounded), where
the reference and the CPU op keep them in f32 until the merge ends: equal at f32. A merged head's
slots keep no positions (nothing reads them): a chat's next turn is fed again whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.chelsea import MERGE_FIELDS, MERGE_WIDTH, launch_merge_rows, merge_scratch_words, method_fields
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.methods.chelsea import PROTECT_POOL_KERNEL, PROTECT_WINDOW, ChelseaConfig

_HELD, _TARGET, _DEGREES, _SCORES, _CAPACITY = (MERGE_FIELDS.index(f) for f in MERGE_FIELDS[:5])


class DeviceChelseaLayerCache(DeviceFullLayerCache):
    """One layer of Chelsea over the device pool, driven by the plugin's model steps: each head's
    count (:attr:`counts`), the merged heads' degrees and scores on the device (:attr:`runs`)."""

    #: a chat's next turn is fed again: a merged head's slots keep no positions to cut it at
    several_tokens_after_prompt = False

    def __init__(
        self, config: ChelseaConfig, pool: DevicePool, kv_heads: int, q_heads: int, outliers: tuple[int, ...],
        layers: int,
    ) -> None:  # fmt: skip
        super().__init__(pool, kv_heads, q_heads)
        assert config.budget is not None
        self.config = config
        #: which heads merge (the others are the layer's outlier heads, kept whole)
        self.merged = np.array([h not in outliers for h in range(kv_heads)])
        self.heads = layers * kv_heads  # the method's heads, against whose budget outliers count
        self.counts = np.zeros(kv_heads, np.int64)
        self.capacity = config.budget + config.merge_interval  # a merged head's most slots
        self.settings = method_fields(config.op_fields(layers, q_heads, pool.shape.block_size))
        #: the first word of the merged heads' degrees, then their protect scores, in the pool's
        #: index arena (None until the prompt is merged)
        self.runs: int | None = None
        #: the merge the step under way does: (slots before, after) of the merged heads
        self.merging: tuple[int, int] | None = None

    # ---- what the plugin's step reads
    def model_slots(self) -> np.ndarray:
        return self.counts.astype(np.int32)

    def merge_fields(self) -> np.ndarray:
        """Each head's row of the model's ``kvc_merge`` ``[kv, MERGE_WIDTH]`` for the step
        :meth:`reserve` made room for (its ``scratch`` left for the step to place)."""
        fields = np.zeros((self.layer.kv_heads, MERGE_WIDTH), np.int32)
        fields[:, _DEGREES] = fields[:, _SCORES] = -1
        if self.runs is None:
            return fields
        fields[self.merged] = self._fields(self.merging or (0, 0))[self.merged]
        return fields

    def _fields(self, merge: tuple[int, int]) -> np.ndarray:
        """Every head's fields over its runs, merging ``merge`` (slots before, after; 0: none)."""
        kv, cap = self.layer.kv_heads, self.capacity
        assert self.runs is not None
        fields = np.zeros((kv, MERGE_WIDTH), np.int32)
        heads = np.arange(kv)
        fields[:, _HELD], fields[:, _TARGET] = merge
        fields[:, _DEGREES] = self.runs + heads * cap
        fields[:, _SCORES] = self.runs + (kv + heads) * cap if self.config.protected_tokens else -1
        fields[:, _CAPACITY] = cap
        fields[:, MERGE_FIELDS.index("sinks") :] = self.settings
        return fields

    def score_rows(self, t: int) -> int:
        """The prompt window's rows among the step's (a chunk's: those of the whole prompt's
        window it holds), where protect_tokens scores the prompt; none otherwise."""
        if self.runs is not None or not self.config.protected_tokens:
            return 0
        prompt = max(self.prompt_end, self.seen)
        return min(t, max(0, self.seen - (prompt - min(PROTECT_WINDOW, prompt))))

    def heads_held(self) -> np.ndarray:
        return self.counts

    def _metadata_bytes(self) -> int:
        return 4 * self._run_words() if self.runs is not None else 0

    def _run_words(self) -> int:
        return self.layer.kv_heads * self.capacity * (2 if self.config.protected_tokens else 1)

    # ---- holding tokens
    def reserve(self, t: int) -> None:
        """Room for a step's ``t`` tokens after each head's slots; a decode step that takes the
        merged heads to the budget plus the merge interval merges them in the model (they hold
        the budget after it: the model attends that many)."""
        if self.runs is None:  # the prompt: every head alike, positions kept (its window's scores)
            super().reserve(t)
            self.counts[:] = self.layer.held
            return
        self.layer.pool.phase = "prompt" if self.in_prompt else "decode"
        counts = self.counts + t
        self.layer.fit_heads(counts)  # the blocks hold the step's tokens before the merge
        self.seen += t
        held, target = int(counts[self.merged].max(initial=0)), self._target()
        if self.merged.any() and held >= target + self.config.merge_interval:
            self.merging = (held, target)
            counts[self.merged] = target
        self.counts = counts

    def _target(self) -> int:
        """What a merged head keeps after ``seen`` tokens (outliers count against the budget)."""
        return self.config.merged_budget(self.seen, self.heads)

    def truncate(self, tokens: int) -> bool:
        """As the full cache's while the prompt is held whole; after it, only a truncation that
        drops nothing (a merged head's slots keep no positions)."""
        if self.runs is None:
            done = super().truncate(tokens)
            self.counts[:] = self.layer.held
            return done
        return tokens >= self.seen

    def release(self) -> None:
        if self.runs is not None:
            self.layer.pool.index_arena().give(self.runs, self._run_words())
            self.runs = None
        super().release()
        self.counts[:] = 0

    # ---- after the model's step
    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """After a prompt's step: its window's scores summed (where protect_tokens asks) and,
        after its last, the prompt merged. After a decode step that merged: the blocks past the
        merged heads' budget back to the pool."""
        if self.runs is None:
            window_sums = self._window_step(sums, t)
            if not self._prompt_continues():
                self._merge_prompt(window_sums)
            return
        if self.merging is not None:
            held, target = self.merging
            self.layer.fit_heads(self.counts)
            self._merged(held, target)
            self.merging = None

    def _window_step(self, sums: Any, t: int) -> Any:
        """The prompt window's per-slot sums ``[Hq, slots]`` so far, this step's (``sums``: the
        model's over its score rows) added (None: no protect, or none of the window yet)."""
        if not self.score_rows(t):
            return self._chunk_sums
        if sums is None:
            raise RuntimeError("chelsea: the model's step gave no window sums for its score rows")
        return self._add_chunk_sums(sums) if self.prompt_end else sums

    def _merge_prompt(self, sums: Any) -> None:
        """The prompt held: the merged heads' runs made, and the heads merged to their budget where
        they reach it plus the merge interval (else only their degrees and scores written), in one
        launch; their protect scores the window's sums pooled per query head."""
        lay, p = self.layer, self.layer.pool
        n, stride = int(self.counts.max(initial=0)), max(self.prompt_end, lay.held)
        self._chunk_sums = None
        self.runs = p.index_arena().take(self._run_words())
        target = self._target()
        merges = n >= target + self.config.merge_interval
        fields = self._fields((n, target if merges else n))
        fields[~self.merged, _HELD] = 0
        words = merge_scratch_words(n)
        fields[:, MERGE_FIELDS.index("scratch")] = np.arange(lay.kv_heads) * words
        scores = None
        if sums is not None and self.config.protected_tokens:
            pooled = p.dev.empty(4 * lay.q_heads * n)
            p.dev.run(p.dev.kernel("snapkv.cl", "pool_rows", {}), (n, lay.q_heads), None, sums, np.int32(stride),
                      np.int32(n), np.int32(PROTECT_POOL_KERNEL), np.int32(0), pooled)  # fmt: skip
            scores = (pooled, lay.q_heads // lay.kv_heads, n)
        tables, width = lay.device_tables()
        launch_merge_rows(p.dev, p.shape, p.buffer, tables, width, p.index_arena().buffer,
                          p.upload("merge fields", fields), lay.kv_heads, p.dev.empty(4 * words * lay.kv_heads),
                          scores)  # fmt: skip
        if merges:
            self.counts[self.merged] = target
            self.layer.fit_heads(self.counts)
            self._merged(n, target)

    def _merged(self, held: int, target: int) -> None:
        kv = int(self.merged.sum())
        self._bump("merges", float((held - target) * kv))
        self._bump("compressions")
