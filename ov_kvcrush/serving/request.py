"""One request the pipeline serves: its sampling and timing state beside its scheduler slot, and
the :class:`~ov_kvcrush.engines.base.GenerationResult` it ends with.

Its progress (the tokens, how many its sequence holds) is its :class:`~ov_kvcrush.serving.scheduler.Slot`'s
alone; its cache is a :class:`~ov_kvcrush.engines.openvino_model.SequenceCache`, either its own
(made at its first step, freed at its end) or one that outlives it (a chat's, ``kept``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.engines.base import GenerationResult, TextStream, step_ms, ttft_tpot_ms
from ov_kvcrush.engines.openvino_model import OpenVINOModel, SequenceCache
from ov_kvcrush.serving.kept import HeldPrompt
from ov_kvcrush.serving.scheduler import Slot


@dataclass(eq=False)
class ServedRequest:
    """A request's sampling and timing state; its progress is its scheduler :class:`Slot`'s."""

    slot: Slot
    settings: GenerationSettings
    stream: TextStream
    rng: np.random.Generator | None
    cache: SequenceCache | None = None  # its sequence and what it holds (made at its first step)
    kept: bool = False  # the cache outlives the request (a chat's): not freed at its end
    held: HeldPrompt | None = None  # its prompt's start before the selection, for a held prompt's cache
    stamps: list[float] = field(default_factory=list)  # seconds since added, per generated token
    added: float = field(default_factory=time.perf_counter)
    started: float | None = None  # first prompt chunk
    chunks: int = 0
    decode_batch: list[int] = field(default_factory=list)  # batch size of each decode step it ran in
    peak_kv_bytes: int = 0
    scoring_s: float = 0.0  # its scoring passes (KVzip)

    def result(self, model: OpenVINOModel, detokenize: Callable[[list[int]], str]) -> GenerationResult:
        """What the request generated and what its cache held (read before the cache is freed)."""
        sequence = self.cache.sequence if self.cache is not None else None
        counters = model.sequence_counters(sequence) if sequence is not None else {}
        stats = sequence.stats() if sequence is not None else None
        ttft_ms, tpot_ms = ttft_tpot_ms(self.stamps)
        prompt, tokens = self.slot.prompt, self.slot.generated
        counters.update(
            prefill_tokens=len(prompt) - self.slot.held_at_start,
            waited_for_pool=self.slot.waited,
            waited_ms=round(((self.started or time.perf_counter()) - self.added) * 1e3, 3),
            prefill_chunks=self.chunks,
            preemptions=self.slot.preemptions,
            decode_batch_mean=round(float(np.mean(self.decode_batch)), 2) if self.decode_batch else 0.0,
        )
        if self.scoring_s:
            counters["scoring_pass_ms"] = round(self.scoring_s * 1e3, 3)
        return GenerationResult(
            text=detokenize(tokens) if tokens else "",
            token_ids=list(tokens),
            prompt_tokens=len(prompt),
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            step_ms=step_ms(self.stamps),
            kv_bytes=stats.kv_bytes if stats else 0,
            # what a full cache holds for the tokens fed (the last generated one never is)
            full_kv_bytes=model.full_kv_bytes(stats.tokens_seen if stats else len(prompt)),
            peak_kv_bytes=max(self.peak_kv_bytes, stats.kv_bytes if stats else 0),
            method=model.compression.method,
            budget=model.compression.budget,
            backend="openvino",
            counters=counters,
        )


__all__ = ["ServedRequest"]
