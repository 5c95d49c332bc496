"""The importance methods' layer caches with their KV on the GPU path's device: H2O, SnapKV
(PyramidKV's budgets a layer's) and Knorm, uniform budgets, single tokens, over the
full-precision store (split from :mod:`ov_kvcrush.gpu.layer_cache`, whose full cache they extend).

Their scores stay on the device: the prompt window's column sums (from the model's own attention
on the plugin's path), pooled per query head, then each decode step's probabilities added
(``snapkv.cl``); the selection runs there (``pooled_group_scores``, then ``kvcrush.cl``'s rank
rule) and an eviction gathers the kept slots into fresh blocks, or a decode step's one drop a
head moves the slots after it down in place. The policy is the reference's
(:mod:`ov_kvcrush.methods.importance`): when to select, how many to keep, sinks and recent tokens.
KVCrush's (:mod:`ov_kvcrush.gpu.kvcrush_cache`) and the 2-bit store's
(:mod:`ov_kvcrush.gpu.quant_cache`) build on SnapKV's here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ov_kvcrush.gpu.arena import SlotState
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache, host_array
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.slots import KeptSlots, StepLogits
from ov_kvcrush.gpu.snapkv import launch_keep
from ov_kvcrush.gpu.step_work import DROP_LOWEST, StepWork
from ov_kvcrush.methods.importance import EvictionConfig, SnapKVConfig
from ov_kvcrush.methods.knorm import KnormConfig


class DeviceH2OLayerCache(DeviceFullLayerCache):
    """H2O over the device pool: every prompt row's probabilities scored, ``budget`` tokens kept
    per KV head (sinks and recent ones always), each decode step's probabilities added and the
    lowest dropped once a head holds more (:class:`~ov_kvcrush.methods.importance.ImportanceLayerCache`'s steps)."""

    def __init__(self, config: EvictionConfig, pool: DevicePool, kv_heads: int, q_heads: int, budget: int) -> None:
        super().__init__(pool, kv_heads, q_heads)
        self.config = config
        self.budget = budget
        #: device [Hq, stride] float32: each held slot's accumulated score (:attr:`scores`)
        self.score_state: SlotState | None = None
        self.stride = 0
        #: the prompt's selection is final (MiniKV): decode steps keep every token
        self.frozen = config.selection_frozen()

    @property
    def scores(self) -> Any:
        """The scores' device buffer (None before the prompt's), taken at each use: it lies in
        the pool's arena, which may have grown since."""
        return self.score_state.buffer if self.score_state is not None else None

    def _metadata_bytes(self) -> int:
        return 4 * self.layer.q_heads * self.stride

    def prompt_scoring(self, tokens: int) -> tuple[int, int, str]:
        """The prompt's rows that score it, and how their sums are pooled: ``(window, width, pool)``.
        H2O's: every row, unpooled."""
        return tokens, 1, "max"

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._start_prefill(queries, keys, values)
        t = keys.shape[2]
        out = self._step(queries, keys, values, self.prompt_scoring(t)[0])
        self._prompt_scored(self._window_scores, t)
        return out

    def _prompt_scored(self, window_sums: Any, t: int) -> None:
        """The prompt's scores from its window's per-slot sums (device ``[Hq, t]``, pooled here;
        none without a window), then the prompt's selection."""
        window, width, pool = self.prompt_scoring(t)
        p, nbytes = self.layer.pool, 4 * self.layer.q_heads * t
        scores = p.slot_state(nbytes)
        if window:
            self._pooled(window_sums, t, width, pool, scores.buffer)
        else:
            p.dev.clear(scores.buffer, nbytes)
        self.score_state, self.stride = scores, t
        self._new_token_scores(0)
        if t > self.budget:
            self._evict(width=1)

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        t = keys.shape[2]
        self._positions(t, keys.device)
        self.layer.pool.phase = "decode"
        before = self.layer.held
        if before + t > self.stride:
            self._grow(before + t)
        if not self.config.decode_attention_scores:  # Knorm: a token's score is its key's alone
            out = self._step(queries, keys, values, 0)
        elif t == 1:
            out = self._decode_token(queries, keys, values)
        else:  # several tokens (a chat turn): every row's probabilities
            out = self._step(queries, keys, values, t)
            self._add(self._window_scores, self.layer.held, before)
        self._decode_scored(before)
        return out

    def _decode_scored(self, before: int) -> None:
        """After a decode step's probabilities were added: the new slots' starting scores, then
        eviction once a head holds more than the budget."""
        self._new_token_scores(before)
        if self.layer.held > self.budget and not self.frozen:
            self._evict(width=1)

    # ---- a model that stores and attends itself: the same scores from the step's query rows
    def reserve(self, t: int) -> None:
        before = self.layer.held
        if self.scores is not None and before + t > self.stride:
            self._grow(before + t)  # as _decode_step grows before its store
        super().reserve(t)

    def truncate(self, tokens: int) -> bool:
        """As the full cache's; the kept slots' scores stay, the dropped ones' start again at zero."""
        if not super().truncate(tokens):
            return False
        if self.scores is not None:
            self._keep_held_scores(self.stride)
        return True

    def score_rows(self, t: int) -> int:
        """The prompt's window rows (H2O: every row) among the step's (a chunk's: those of the
        whole prompt's window it holds, its last rows); a decode step's rows; none for Knorm's."""
        if self.scores is None:
            prompt = max(self.prompt_end, self.seen)
            window = self.prompt_scoring(prompt)[0]
            return min(t, max(0, self.seen - (prompt - window)))
        return t if self.config.decode_attention_scores else 0

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """:meth:`prefill`'s or :meth:`_decode_step`'s scores and selection: a decode row's
        probabilities from the logits the model's attention wrote (``logits``), else the step's
        score rows' sums as the model's attention gave them (``sums``: the prompt window's sums, a
        decode row's probabilities)."""
        lay = self.layer
        n = self.score_rows(t)
        if n and logits is None and sums is None:
            raise RuntimeError(f"{type(self).__name__}: the model's step gave no logits or sums for its score rows")
        if self.scores is None:
            window_sums = sums if n else None
            if self.prompt_end:
                window_sums = self._add_chunk_sums(window_sums)
                if self._prompt_continues():
                    return
                self._chunk_sums = None  # now the prompt's (H2O's scores are its sums)
            self._prompt_scored(window_sums, self.seen)
            return
        before = lay.held - t
        if n == 1 and logits is not None:
            self._add_logits(logits, lay.held - 1)
        elif n:
            self._add(sums, lay.held, before)
        self._decode_scored(before)

    def step_work(self, t: int, logits: StepLogits | None) -> StepWork | None:
        """A decode token's :meth:`after_model_step`: its probabilities added from the logits,
        the new slot's starting score, and past the budget the lowest middle slot dropped, or a
        selection anew (KVCrush's) once the launch has added them (:attr:`StepWork.then`); None
        for any other step (a prompt, several tokens)."""
        lay, cfg = self.layer, self.config
        n, held = self.score_rows(t), lay.held
        if self.scores is None or t != 1 or lay.pool.slot_arena is None or (n and logits is None):
            return None
        work = StepWork(lay, self.score_state, self.stride, held=held)
        if n:
            work.add_from, work.scored = held - 1, self._scored()
        self._new_token_work(work, held - 1)
        if held <= self.budget or self.frozen:
            return work
        if self._drops_one_lowest(held):
            work.drop_one(DROP_LOWEST, cfg.sink_tokens, held - cfg.sink_tokens - cfg.recent_tokens)
            self._bump("evicted", float(lay.kv_heads))
        else:
            self._select_in_step(work)
        return work

    def _select_in_step(self, work: StepWork) -> None:
        """A decode step's selection anew of many slots: the sequence's own work after the step's
        launches (:attr:`StepWork.then`)."""
        work.then = self._select_anew

    def _select_anew(self) -> None:
        """A decode step's selection of many slots (:meth:`_evict`), after the step's launch has
        added its probabilities and the new slot's starting score."""
        self._evict(width=1)

    def _new_token_work(self, work: StepWork, first: int) -> None:
        """:meth:`_new_token_scores` as a part of the step's ``work``: H2O's start at zero."""

    def _decode_token(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.layer.append(host_array(keys), host_array(values), self.seen - 1)
        q = host_array(queries)
        out, probs, stride = self.layer.attend_decode(q[:, 0], self._scale(q.shape[2]))
        self._add(probs, stride, self.layer.held - 1)
        return torch.from_numpy(out)[None, :, None].to(queries.dtype)

    def _new_token_scores(self, first: int) -> None:
        """The starting scores of the slots stored from ``first`` on, beside their attention
        (the reference's ``new_token_scores``): H2O's start at zero, where they already are."""

    # ---- the scores, on the device
    def _kernel(self, name: str, source: str = "snapkv.cl") -> Any:
        return self.layer.pool.dev.kernel(source, name, {})

    def _pooled(self, sums: Any, n: int, width: int, pool: str, out: Any) -> None:
        """The window's sums ``[Hq, n]`` pooled along the slots (``width`` 1: as they are) into ``out``."""
        dev = self.layer.pool.dev
        if width == 1:
            dev.copy_bytes(sums, out, 4 * self.layer.q_heads * n, 0)
            return
        i32 = np.int32
        dev.run(self._kernel("pool_rows"), (n, self.layer.q_heads), None, sums, i32(n), i32(n), i32(width),
                i32(pool == "avg"), out)  # fmt: skip

    def _scored(self) -> int:
        """Slots the scores cover (the store's: here the pool's)."""
        return self.layer.held

    def _add(self, probs: Any, prob_stride: int, before: int) -> None:
        i32 = np.int32
        held = self._scored()
        self.layer.pool.dev.run(self._kernel("add_step_scores"), (held, self.layer.q_heads), None, self.scores,
                                i32(self.stride), i32(before), i32(held), probs, i32(prob_stride))  # fmt: skip

    def _add_logits(self, logits: StepLogits, before: int) -> None:
        """:meth:`_add` of a decode row's probabilities taken from its logits and log-sum-exp."""
        i32 = np.int32
        self.layer.pool.dev.run(self._kernel("add_step_logits"), (self._scored(), self.layer.q_heads), None,
                                self.scores, i32(self.stride), i32(before), logits.buffer, i32(logits.stride),
                                i32(logits.rows), i32(logits.row))  # fmt: skip

    def _gather_scores(self, kept: tuple[Any, int], count: int, stride: int,
                       source: tuple[SlotState, int] | None = None) -> SlotState:  # fmt: skip
        """The scores of each KV head's slots ``kept`` (device ``[kv, count]`` and its row stride:
        0 when every head keeps the same list; -1: the first ``count`` slots, no list) in a new
        buffer of row stride ``stride``; from ``source`` (scores and their row stride) where
        given, else the scores."""
        dev, lay = self.layer.pool.dev, self.layer
        scores, scores_stride = (source[0].buffer, source[1]) if source else (self.scores, self.stride)
        out = lay.pool.slot_state(4 * lay.q_heads * max(stride, 1))  # written whole: zero past the kept slots
        i32 = np.int32
        dev.run(self._kernel("gather_rows"), (max(stride, 1), lay.q_heads), None, scores, i32(scores_stride),
                kept[0], i32(kept[1]), i32(count), i32(lay.q_heads // lay.kv_heads), out.buffer,
                i32(stride))  # fmt: skip
        return out

    def _grown_stride(self, need: int) -> int:
        """The row stride of scores grown for ``need`` slots: twice the old, and past the budget."""
        return max(need, self.budget + 1, 2 * self.stride)

    def _grow(self, need: int) -> None:
        """Room for ``need`` slots' scores (the held ones copied over)."""
        self._keep_held_scores(self._grown_stride(need))

    def _keep_held_scores(self, stride: int) -> None:
        """The held slots' scores copied into a fresh buffer of row stride ``stride``, zero past them."""
        held = self._scored()
        self.score_state = self._gather_scores((self.layer.pool.no_slots, -1), held, stride)  # slots 0 .. held
        self.stride = stride

    def _evict(self, width: int) -> None:
        """Keep the selection's slots in every KV head (fresh blocks; their scores gathered), or,
        where one slot a head goes (a decode step past the budget), drop it in place."""
        lay = self.layer
        n = lay.held
        if self._drops_one_lowest(n):
            self._drop_lowest(n)
            return
        kept = self._select(n, width)
        # the kept slots' scores with room for the next decode token, not the prompt's width: a
        # 32k-token prompt's rows would hold as many bytes as the budget's KV blocks
        stride = min(self.stride, max(kept.count, self.budget) + 1)
        scores = lay.pool.slot_state(4 * lay.q_heads * max(stride, 1))  # written whole: zero past the kept slots
        lay.keep(kept, (self.scores, self.stride, scores.buffer, stride))  # the slots and their scores, one launch
        self.score_state, self.stride = scores, stride
        self._bump("evicted", float((n - kept.count) * lay.kv_heads))

    def _drops_one_lowest(self, n: int) -> bool:
        """Whether an eviction of ``n`` held slots drops the one lowest middle slot a head, in place."""
        cfg = self.config
        return n == self.budget + 1 and self._drops_lowest() and n > cfg.sink_tokens + cfg.recent_tokens

    def _drops_lowest(self) -> bool:
        """Whether the selection keeps the top summed scores (H2O's rank rule), so that one slot
        going is the lowest middle one (KVCrush's selection is not)."""
        return True

    def _drop_lowest(self, n: int) -> None:
        """:meth:`_select` of all but one slot a head, in place: the middle slot of the lowest
        summed score (ties: the later, as the rank rule keeps the earlier) dropped, the slots
        after it moved down with their scores and positions (not every kept slot gathered)."""
        lay, cfg = self.layer, self.config
        dev, kv, i32 = lay.pool.dev, lay.kv_heads, np.int32
        dropped = dev.empty(4 * kv)
        mid = n - cfg.sink_tokens - cfg.recent_tokens
        dev.run(self._kernel("drop_lowest"), (dev.sub_group, kv), (dev.sub_group, 1), self.scores, i32(self.stride),
                i32(lay.q_heads // kv), i32(cfg.sink_tokens), i32(mid), dropped)  # fmt: skip
        lay.drop_one(dropped, (self.scores, self.stride))
        self._bump("evicted", float(kv))

    def _select(self, n: int, width: int) -> KeptSlots:
        """Each KV head's sinks, recent tokens and top summed scores (``budget`` in all), listed
        on the device from the decisions made there: nothing comes back to the host."""
        lay, cfg = self.layer, self.config
        dev, kv = lay.pool.dev, lay.kv_heads
        sinks, recent = cfg.sink_tokens, cfg.recent_tokens
        decisions_b, mid = launch_keep(dev, self.scores, self.stride, n, lay.q_heads // kv, kv, self.budget, sinks,
                                       recent, width)  # fmt: skip
        kept_b = dev.empty(4 * kv * self.budget)
        i32 = np.int32
        dev.run(self._kernel("kept_slots"), (kv,), None, decisions_b, i32(mid), i32(sinks), i32(recent), i32(n),
                kept_b, i32(self.budget))  # fmt: skip
        return KeptSlots(kept_b, self.budget, self.budget)


class DeviceKnormLayerCache(DeviceH2OLayerCache):
    """Knorm over the device pool: each token scored once, as it is stored, by ``-||k||`` of its
    cached key (the reference's ``key_norm_scores``, computed where the keys lie); no attention
    adds to it; the selection is H2O's."""

    config: KnormConfig

    def prompt_scoring(self, tokens: int) -> tuple[int, int, str]:
        return 0, 1, "max"  # no row's probabilities

    def _new_token_scores(self, first: int) -> None:
        self.layer.key_norms(first, self.layer.held - first, self.scores, self.stride)

    def _new_token_work(self, work: StepWork, first: int) -> None:
        work.norms_from = first


class DeviceSnapKVLayerCache(DeviceH2OLayerCache):
    """SnapKV over the device pool: the prompt scored by its last ``window`` rows, pooled along
    tokens per query head; the rest is H2O's."""

    config: SnapKVConfig

    def prompt_scoring(self, tokens: int) -> tuple[int, int, str]:
        if self.config.scoring_mode() != "snapkv":  # as SnapKVConfig.prompt_scores falls back
            return super().prompt_scoring(tokens)
        return min(self.config.window, tokens), self.config.pool_width, self.config.pool
