"""Requests from the event loop onto the pipeline's worker thread and their text back.

The pipeline (:class:`~ov_kvcrush.serving.ContinuousBatchingPipeline`) steps in its own worker
thread; each request's streamer hands its new text to the event loop, which the HTTP answer
reads. Stop strings are found in that text (the pipeline has none): the request is stopped at
the first, and nothing past it is ever sent. A request whose client went away is cancelled, so
its blocks go back to the pool at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.base import GenerationResult, check_context
from ov_kvcrush.engines.openvino_model import SequenceCache
from ov_kvcrush.errors import UserError
from ov_kvcrush.op.plugin import PluginError
from ov_kvcrush.server.metrics import DISK_EVENT, ServerMetrics
from ov_kvcrush.server.protocol import APIError, GenerationRequest, compression_error
from ov_kvcrush.serving.handle import GenerationHandle, GenerationStatus
from ov_kvcrush.serving.kept import shared_prefix
from ov_kvcrush.serving.persist import DiskCaches
from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline


class StopText:
    """Text as it streams, held back where it could still be the start of a stop string."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = stops
        self.include = include  # the stop string itself is sent
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, delta: str) -> str:
        """The part of the text now safe to send (everything, once stopped, up to the stop)."""
        if self.stopped:
            return ""
        self.text += delta
        found = ((self.text.find(s), len(s)) for s in self.stops)
        hits = [(i, i + n if self.include else i) for i, n in found if i >= 0]  # (start, where the answer ends)
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)[1]]
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
    """A finished request: its text (cut at a stop string), why it ended, its result, how many of
    its prompt tokens came from a kept cache instead of being prefilled, and whether a stop
    string ended it."""

    text: str
    finish_reason: str
    result: GenerationResult
    cached_tokens: int = 0
    stopped: bool = False


#: a refused or failed request's outcome in the metrics, by its status
OUTCOMES = {400: "bad_request", 429: "queue_full", 500: "failed"}


class Backend(ABC):
    """What the app serves: requests admitted up to ``max_queue`` at once, their text streamed,
    and the metrics they leave. :class:`PipelineBackend` runs them here; the Ray backend
    (``server/ray_serve.py``) on replicas."""

    def __init__(self, model_name: str, max_queue: int) -> None:
        self.model_name = model_name
        self.max_queue = max_queue
        self._in_flight = 0
        self._lock = threading.Lock()
        self.metrics = ServerMetrics(self.stats)

    @abstractmethod
    def stream(self, req: GenerationRequest) -> AsyncIterator[str | Answer]:
        """The request's text as it comes (str pieces), then its :class:`Answer` (no admission)."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """The gauges: ``running``, ``waiting``, ``blocks_used``, ``blocks_free`` (-1: unbounded),
        ``kv_bytes``, ``kept``, ``kept_blocks``, ``on_disk``, ``on_disk_bytes``; and the disk's
        file events since start (``disk_saved``, ``disk_restored``, ``disk_rejected_<reason>``)."""

    def replica_for(self, req: GenerationRequest) -> str | None:
        """Which replica serves ``req`` (``None``: this process)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release what the backend holds beyond its process (kept caches, a Ray deployment)."""

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

    async def generate(self, req: GenerationRequest) -> AsyncIterator[str | Answer]:
        """:meth:`stream`, admitted and counted: a request that ends before its answer (its
        client went away) counts as disconnected."""
        self._admit()
        answered = False
        try:
            async for item in self.stream(req):
                if isinstance(item, Answer):
                    answered = True
                    outcome = "stopped" if item.stopped else "finished"
                    self.metrics.finished(item.result, outcome, item.cached_tokens)
                yield item
        except APIError as e:
            answered = True
            self.metrics.refused(OUTCOMES.get(e.status, "failed"))
            raise
        finally:
            if not answered:
                self.metrics.refused("disconnected")
            with self._lock:
                self._in_flight -= 1

    async def complete(self, req: GenerationRequest) -> Answer:
        answer = None
        async for item in self.generate(req):
            if isinstance(item, Answer):
                answer = item
        assert answer is not None
        return answer


def compression_key(config: CompressionConfig) -> str:
    """One string per distinct compression (its fields, sorted)."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True, default=repr)


class PipelineBackend(Backend):
    """Pipelines of this process served to many connections: the server's method's, and one per
    other method requests name (``kv_compression``), each with its own pool, made on first use,
    at most ``max_methods`` in all."""

    def __init__(
        self,
        pipeline: ContinuousBatchingPipeline,
        model_name: str,
        max_queue: int,
        keep_caches: bool = True,
        make_pipeline: Callable[[CompressionConfig], ContinuousBatchingPipeline] | None = None,
        max_methods: int = 4,
        disk: Callable[[ContinuousBatchingPipeline], DiskCaches] | None = None,
    ) -> None:
        super().__init__(model_name, max_queue)
        self.pipeline = pipeline  # the server's own method's
        #: keep each finished request's cache for its conversation's next turn (serving/kept.py)
        self.keep_caches = keep_caches
        self.make_pipeline = make_pipeline
        self.max_methods = max_methods
        self._making = threading.Lock()
        #: each pipeline's conversation caches on disk (``--cache-dir``), made with it
        self.make_disk = disk
        self.disks: dict[int, DiskCaches] = {}
        self.pipelines: dict[str, ContinuousBatchingPipeline] = {}
        self._add(compression_key(pipeline.engine.compression), pipeline)

    def pipeline_for(self, compression: CompressionConfig | None) -> ContinuousBatchingPipeline:
        """The pipeline of ``compression`` (``None``: the server's), made the first time."""
        if compression is None:
            return self.pipeline
        key = compression_key(compression)
        if key not in self.pipelines:
            try:  # the server's engine says what it runs on its device (Quest on GPU, not on the CPU)
                self.pipeline.engine.check_compression(compression)
            except UserError as e:
                raise compression_error(e, dict(compression.options)) from e
        with self._making:
            if key not in self.pipelines:
                if self.make_pipeline is None or len(self.pipelines) >= self.max_methods:
                    raise APIError(
                        400,
                        f"kv_compression: this server runs at most {self.max_methods} methods at once "
                        f"(--max-methods), all taken: send one of theirs or none",
                        "kv_compression",
                    )
                self._add(key, self.make_pipeline(compression))
            return self.pipelines[key]

    def _add(self, key: str, pipeline: ContinuousBatchingPipeline) -> None:
        """Serve ``pipeline`` for compression ``key``, with its caches on disk where it keeps them."""
        if self.make_disk is not None and self._kept_by(pipeline):
            self.disks[id(pipeline)] = self.make_disk(pipeline)
        self.pipelines[key] = pipeline

    def _kept_by(self, pipeline: ContinuousBatchingPipeline) -> bool:
        """Whether ``pipeline``'s finished requests' caches are kept for the next turn."""
        return self.keep_caches and pipeline.keeps_turns

    def stats(self) -> dict[str, int]:
        total = dict.fromkeys(
            (
                "running",
                "waiting",
                "blocks_used",
                "blocks_free",
                "kv_bytes",
                "kept",
                "kept_blocks",
                "on_disk",
                "on_disk_bytes",
            ),
            0,
        )
        for pipeline in list(self.pipelines.values()):
            st = pipeline.pool.stats()
            limit = pipeline.engine.max_kv_blocks
            total["running"] += len(pipeline.scheduler.running)
            total["waiting"] += len(pipeline.scheduler.waiting)
            total["blocks_used"] += st.blocks_in_use
            total["blocks_free"] = (
                -1 if not limit or total["blocks_free"] < 0 else total["blocks_free"] + limit - st.blocks_in_use
            )
            total["kv_bytes"] += st.kv_bytes
            total["kept"] += len(pipeline.kept)
            total["kept_blocks"] += pipeline.kept.blocks()
        for disk in list(self.disks.values()):
            total["on_disk"] += len(disk)
            total["on_disk_bytes"] += disk.bytes_on_disk()
            for event, n in disk.counts.items():
                total[DISK_EVENT + event] = total.get(DISK_EVENT + event, 0) + n
        return total

    def close(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.kept.clear()

    async def stream(self, req: GenerationRequest) -> AsyncIterator[str | Answer]:
        pipeline = await asyncio.to_thread(self.pipeline_for, req.compression)  # a first one compiles
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        stop = StopText(req.stop, req.include_stop)
        handle: GenerationHandle | None = None
        cache: SequenceCache | None = None
        state = {"cancel": False}

        def streamer(delta: str) -> bool:  # the pipeline's worker thread
            loop.call_soon_threadsafe(pieces.put_nowait, delta)
            return state["cancel"] or stop.stopped or _stop_seen(stop, delta)

        try:
            try:
                ids = pipeline.encode(req.prompt, req.settings.apply_chat_template)
                try:  # the loop checks it too; here it is named as the client named it
                    check_context(len(ids), req.settings.max_new_tokens, pipeline.engine.max_context,
                                  req.max_tokens_param)  # fmt: skip
                except UserError as e:
                    raise APIError(400, str(e), req.max_tokens_param) from e
                cache = await asyncio.to_thread(self._cache_for, pipeline, ids)
                cached = min(shared_prefix(cache.ids, ids), len(ids) - 1) if cache is not None else 0
                holds = cache is not None and cache.holds_prompt  # the full cache's kept turn needs no cuts
                turns = pipeline.turn_prompts(req.prompt, req.settings.apply_chat_template) if holds else []
                handle = pipeline.submit(ids, req.settings, streamer, cache=cache, turns=turns)
            except UserError as e:
                if cache is not None:
                    pipeline.kept.put(cache)
                raise APIError(400, str(e)) from e
            done = loop.run_in_executor(None, _wait_and_keep, pipeline, handle, cache, self.disks.get(id(pipeline)))
            done.add_done_callback(lambda _f: loop.call_soon_threadsafe(pieces.put_nowait, None))
            while (delta := await pieces.get()) is not None:
                out = stop.add(delta)
                if out:
                    yield out
            status, result, error = await done
            if status is GenerationStatus.FAILED or result is None:
                raise APIError(500, f"generation failed: {error}", kind="server_error")
            rest = stop.rest()
            if rest:
                yield rest
            reason = "length" if not stop.stopped and result.generated_tokens >= req.settings.max_new_tokens else "stop"
            yield Answer(stop.text, reason, result, cached, stop.stopped)
        finally:
            state["cancel"] = True
            if handle is not None and not handle.done():
                handle.cancel()

    def _cache_for(self, pipeline: ContinuousBatchingPipeline, ids: list[int]) -> SequenceCache | None:
        """The kept cache this request continues (its conversation's last turn), or a new one to
        keep (:meth:`~ov_kvcrush.serving.loop.GenerationLoop.turn_cache`: the full cache's
        sequence, another method's held prompt); ``None`` when the server keeps none, or the pool
        cannot (a held prompt needs snapshots: not on device GPU)."""
        if not self._kept_by(pipeline):
            return None
        disk = self.disks.get(id(pipeline))
        return (
            pipeline.kept.take(ids)
            or (disk.restore(ids, pipeline.pool) if disk is not None else None)
            or pipeline.turn_cache()
        )


def _wait_and_keep(
    pipeline: ContinuousBatchingPipeline,
    handle: GenerationHandle,
    cache: SequenceCache | None,
    disk: DiskCaches | None = None,
) -> tuple[GenerationStatus, GenerationResult | None, str]:
    """The request's end (a worker thread); then its cache is kept for the next turn (a failed
    request's, reset by the loop, is freed), written to ``disk`` first (before another request
    may take it). A write that fails is counted and logged; the request has its answer."""
    outcome = _wait(handle)
    if cache is not None:
        if outcome[0] is GenerationStatus.FAILED:
            cache.sequence.free()
            return outcome
        if disk is not None:
            try:
                disk.save(cache)
            except (OSError, UserError, PluginError) as e:
                disk.counts["write_failed"] += 1
                print(f"ov-kvcrush: a conversation cache was not written to disk: {e}", file=sys.stderr)
        pipeline.kept.put(cache)
    return outcome


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
