"""Requests from the event loop onto the pipeline's worker thread and their text back.

The pipeline (:class:`~ov_kvcrush.serving.ContinuousBatchingPipeline`) steps in its own worker
thread; each request's streamer hands its new text to the event loop, which the HTTP answer
reads. Stop strings are found in that text (the pipeline has none): the request is stopped at
the first, and nothing past it is ever sent. A request whose client went away is cancelled, so
its blocks go back to the pool at the next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ov_kvcrush.engines.base import GenerationResult
from ov_kvcrush.engines.openvino_model import SequenceCache
from ov_kvcrush.errors import UserError
from ov_kvcrush.server.metrics import ServerMetrics
from ov_kvcrush.server.protocol import APIError, GenerationRequest
from ov_kvcrush.serving.handle import GenerationHandle, GenerationStatus
from ov_kvcrush.serving.kept import shared_prefix
from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline


class StopText:
    """Text as it streams, held back where it could still be the start of a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, delta: str) -> str:
        """The part of the text now safe to send (everything, once stopped, up to the stop)."""
        if self.stopped:
            return ""
        self.text += delta
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            end = len(self.text)
        else:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : end], end
        return out

    def rest(self) -> str:
        """What is left to send at the end (the held-back tail, when no stop came)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass
class Answer:
    """A finished request: its text (cut at a stop string), why it ended, its result, and how
    many of its prompt tokens came from a kept cache instead of being prefilled."""

    text: str
    finish_reason: str
    result: GenerationResult
    cached_tokens: int = 0


class Backend:
    """One pipeline served to many connections, with a limit on requests in flight."""

    def __init__(
        self, pipeline: ContinuousBatchingPipeline, model_name: str, max_queue: int, keep_caches: bool = True
    ) -> None:
        self.pipeline = pipeline
        self.model_name = model_name
        self.max_queue = max_queue
        #: keep each finished request's cache for its conversation's next turn (serving/kept.py)
        self.keep_caches = keep_caches
        self._in_flight = 0
        self._lock = threading.Lock()
        self.metrics = ServerMetrics(
            running=lambda: len(pipeline.scheduler.running),
            waiting=lambda: len(pipeline.scheduler.waiting),
            blocks_used=lambda: pipeline.pool.stats().blocks_in_use,
            blocks_free=self._free_blocks,
            kv_bytes=lambda: pipeline.pool.stats().kv_bytes,
            kept=lambda: len(pipeline.kept),
            kept_blocks=pipeline.kept.blocks,
        )

    def _free_blocks(self) -> int:
        free = self.pipeline.engine.max_kv_blocks
        return -1 if not free else free - self.pipeline.pool.stats().blocks_in_use

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _admit(self) -> None:
        with self._lock:
            if self._in_flight >= self.max_queue:
                self.metrics.refused("queue_full")
                raise APIError(
                    429,
                    f"the server holds {self.max_queue} requests (--max-queue): retry later",
                    kind="rate_limit_error",
                )
            self._in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    async def generate(self, req: GenerationRequest) -> AsyncIterator[str | Answer]:
        """The request's text as it comes (str pieces), then its :class:`Answer`."""
        self._admit()
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        stop = StopText(req.stop)
        handle: GenerationHandle | None = None
        cache: SequenceCache | None = None
        state = {"cancel": False}

        def streamer(delta: str) -> bool:  # the pipeline's worker thread
            loop.call_soon_threadsafe(pieces.put_nowait, delta)
            return state["cancel"] or stop.stopped or _stop_seen(stop, delta)

        try:
            try:
                ids = self.pipeline.encode(req.prompt, req.settings.apply_chat_template)
                cache = self._cache_for(ids)
                cached = min(shared_prefix(cache.ids, ids), len(ids) - 1) if cache is not None else 0
                handle = self.pipeline.submit(ids, req.settings, streamer, cache=cache)
            except UserError as e:
                self.metrics.refused("bad_request")
                if cache is not None:
                    self.pipeline.kept.put(cache)
                raise APIError(400, str(e)) from e
            done = loop.run_in_executor(None, self._wait_and_keep, handle, cache)
            done.add_done_callback(lambda _f: loop.call_soon_threadsafe(pieces.put_nowait, None))
            while (delta := await pieces.get()) is not None:
                out = stop.add(delta)
                if out:
                    yield out
            status, result, error = await done
            if status is GenerationStatus.FAILED or result is None:
                self.metrics.refused("failed")
                raise APIError(500, f"generation failed: {error}", kind="server_error")
            rest = stop.rest()
            if rest:
                yield rest
            reason = "length" if not stop.stopped and result.generated_tokens >= req.settings.max_new_tokens else "stop"
            self.metrics.finished(result, "stopped" if stop.stopped else "finished", cached)
            yield Answer(stop.text, reason, result, cached)
        finally:
            state["cancel"] = True
            if handle is not None and not handle.done():
                handle.cancel()
                self.metrics.refused("disconnected")
            self._leave()

    def _cache_for(self, ids: list[int]) -> SequenceCache | None:
        """The kept cache this request continues (its conversation's last turn), or a new one to
        keep; ``None`` when caches are not kept."""
        if not self.keep_caches:
            return None
        return self.pipeline.kept.take(ids) or SequenceCache(self.pipeline.pool.new_sequence())

    def _wait_and_keep(
        self, handle: GenerationHandle, cache: SequenceCache | None
    ) -> tuple[GenerationStatus, GenerationResult | None, str]:
        """The request's end (a worker thread); then its cache is kept for the next turn (a
        failed request's, reset by the loop, is freed)."""
        outcome = _wait(handle)
        if cache is not None:
            if outcome[0] is GenerationStatus.FAILED:
                cache.sequence.free()
            else:
                self.pipeline.kept.put(cache)
        return outcome

    async def complete(self, req: GenerationRequest) -> Answer:
        answer = None
        async for item in self.generate(req):
            if isinstance(item, Answer):
                answer = item
        assert answer is not None
        return answer


def _stop_seen(stop: StopText, delta: str) -> bool:
    """Whether the text so far (with ``delta``, not yet added by the event loop) holds a stop string."""
    if not stop.stops:
        return False
    tail = stop.text[-max(len(s) for s in stop.stops) :] + delta
    return any(s in tail for s in stop.stops)


def _wait(handle: GenerationHandle) -> tuple[GenerationStatus, GenerationResult | None, str]:
    try:
        return handle.status, handle.result(), ""
    except UserError:
        return handle.status, None, handle.error
