"""StreamingLLM's layer cache over the GPU path's device pool: the sinks and a window of the
latest tokens, no scores (the reference's :class:`~ov_kvcrush.methods.importance.StreamingLLMConfig`).
Split from :mod:`ov_kvcrush.gpu.layer_cache`, whose full cache it extends."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.slots import KeptSlots, StepLogits
from ov_kvcrush.gpu.snapkv import kept_tokens
from ov_kvcrush.gpu.step_work import StepWork
from ov_kvcrush.methods.importance import StreamingLLMConfig


class DeviceStreamingLLMLayerCache(DeviceFullLayerCache):
    """StreamingLLM over the device pool: the sinks and the last ``budget - sinks`` tokens, no
    scores. A decode step past the budget drops the window's oldest slot in place (the slots
    after it moved down: ``drop_slot``); a longer overflow (a prompt) lists the kept slots on the
    device (``kept_slots`` with no middle tokens) and gathers them, so only new tables cross."""

    def __init__(self, config: StreamingLLMConfig, pool: DevicePool, kv_heads: int, q_heads: int, budget: int) -> None:
        super().__init__(pool, kv_heads, q_heads)
        self.budget = budget
        self.sinks = config.sink_tokens
        self.recent = budget - config.sink_tokens  # as the reference's make_layer
        #: the slot a decode step drops in every head (the window's oldest), on the device once
        self._oldest = pool.upload("dropped slots", np.full(kv_heads, self.sinks, np.int32))

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super().prefill(queries, keys, values)
        self._evict()
        return out

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = super()._decode_step(queries, keys, values)
        self._evict()
        return out

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        if not self._prompt_continues():  # a chunked prompt is evicted after its last chunk
            self._evict()

    def step_work(self, t: int, logits: StepLogits | None) -> StepWork | None:
        """A step that takes the window one slot past the budget: its oldest slot dropped, as a
        row of the step's launch; None for any other (nothing to drop, or a prompt's eviction)."""
        lay = self.layer
        if self._prompt_continues() or lay.held != self.budget + 1 or self.recent <= 0 or lay.pool.slot_arena is None:
            return None
        work = StepWork(lay, held=lay.held)
        work.drop_one(self.sinks, host_dropped=np.full(lay.kv_heads, self.sinks))
        self._bump("evicted", float(lay.kv_heads))
        return work

    def _evict(self) -> None:
        lay = self.layer
        n, kv = lay.held, lay.kv_heads
        if n <= self.budget:
            return
        if n == self.budget + 1 and self.recent > 0:  # one slot a head: the window's oldest, in place
            lay.drop_one(self._oldest, host_dropped=np.full(kv, self.sinks))
            self._bump("evicted", float(kv))
            return
        mid = n - self.sinks - self.recent
        kept = np.stack(kept_tokens(np.zeros((kv, mid), np.uint8), n, self.sinks, self.recent))
        dev = lay.pool.dev
        kept_b = dev.empty(4 * kept.size)
        i32 = np.int32
        # no middle token is kept: no decisions are read (kept_b stands in for them)
        dev.run(dev.kernel("snapkv.cl", "kept_slots", {}), (kv,), None, kept_b, i32(0), i32(self.sinks),
                i32(self.recent), i32(n), kept_b, i32(kept.shape[1]))  # fmt: skip
        lay.keep(KeptSlots(kept_b, kept.shape[1], kept.shape[1], kept))
        self._bump("evicted", float((n - kept.shape[1]) * kv))
