"""Continuous batching over our op: many requests, one block pool, one inference per decode step.

Shaped like ``openvino_genai.ContinuousBatchingPipeline`` (what OpenVINO Model Server serves)::

    pipe = ContinuousBatchingPipeline(model_dir, scheduler_config, compression=CompressionConfig("kvcrush", 1024))
    results = pipe.generate(prompts, GenerationSettings(max_new_tokens=64))      # one result per prompt

    handle = pipe.add_request(0, "question", GenerationSettings(max_new_tokens=32))
    while pipe.has_non_finished_requests():
        pipe.step()
    print(handle.result())

    handle = pipe.submit("question", streamer=print)   # from any thread: a worker thread steps
    print(handle.result())

Every step (:meth:`ContinuousBatchingPipeline.step`) is **one** inference: at most one prompt
chunk (the op prefills a prompt in chunks and runs the method's prompt selection once, on the
last one) side by side with the decode token of every sequence past its prompt, as native
continuous batching runs a step. The tokens go through the model's matmuls together, each
carrying its sequence's handle, and the op attends each sequence's run of tokens as that
sequence's step (:func:`ov_kvcrush.engines.model_inputs.ragged_step_inputs`); a decode-only step
is a batch of one-token rows. Each request has its own sequence in the engine's
pool, its own method state and its own generation settings; a finished request's blocks go back
at once. What runs when, and what waits, is :mod:`ov_kvcrush.serving.scheduler`'s.

With the plugin's bf16 inference precision the model's matmuls round a row differently in a
batch than alone (their kernels depend on the batch), so greedy tokens can part from a
one-at-a-time run at a near-tie, as with native continuous batching; at f32 they do not
(tested).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ov_kvcrush.config import CompressionConfig, GenerationSettings, generation_settings
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer, TextStream, check_context, step_ms, ttft_tpot_ms
from ov_kvcrush.engines.openvino_engine import OpenVINOEngine, error_line
from ov_kvcrush.engines.sampling import sample_token
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.op.kvcache import KVSequence, infer_steps
from ov_kvcrush.serving.handle import GenerationHandle, GenerationStatus
from ov_kvcrush.serving.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    Scheduler,
    SchedulerLimits,
    Slot,
)
from ov_kvcrush.validation import check_int


@dataclass(eq=False)
class _Request:
    """A request's sampling and timing state; its progress (tokens, how many fed) is its
    scheduler :class:`Slot`'s."""

    slot: Slot
    settings: GenerationSettings
    stream: TextStream
    rng: np.random.Generator | None
    sequence: KVSequence | None = None
    stamps: list[float] = field(default_factory=list)  # seconds since added, per generated token
    added: float = field(default_factory=time.perf_counter)
    started: float | None = None  # first prompt chunk
    chunks: int = 0
    decode_batch: list[int] = field(default_factory=list)  # batch size of each decode step it ran in
    peak_kv_bytes: int = 0
    scoring_s: float = 0.0  # its scoring passes (KVzip)


class ContinuousBatchingPipeline:
    """Serve many requests over one KV block pool with our op (see the module doc).

    Args:
        model: an exported IR directory (``None``: the embedded model), or an :class:`OpenVINOEngine`
            to share (its compiled model, tokenizer, compression and pool: ``scheduler_config`` then
            gives only the scheduling limits).
        scheduler_config: an ``openvino_genai.SchedulerConfig``: ``max_num_seqs``,
            ``max_num_batched_tokens``, ``dynamic_split_fuse``, the pool (``num_kv_blocks`` /
            ``cache_size``) and, with ``use_cache_eviction``, the compression; ``None``: its defaults.
        device: ``CPU``.
        compression: our method and budget (instead of the scheduler config's cache eviction).
        **engine_options: :class:`OpenVINOEngine` options (``kv_precision``, ``block_size``,
            ``max_kv_blocks``, ``properties``).
    """

    def __init__(
        self,
        model: str | Path | OpenVINOEngine | None = None,
        scheduler_config: Any = None,
        device: str = "CPU",
        *,
        compression: CompressionConfig | None = None,
        **engine_options: Any,
    ) -> None:
        sc = scheduler_config
        if sc is not None:
            import openvino_genai as ov_genai

            if not isinstance(sc, ov_genai.SchedulerConfig):
                raise ConfigError("scheduler_config", sc, "an openvino_genai.SchedulerConfig")
            if sc.enable_prefix_caching:
                raise ConfigError(
                    "scheduler_config.enable_prefix_caching", True, "False (not implemented by backend openvino)"
                )
        if isinstance(model, OpenVINOEngine):  # its compression and pool are set: sc gives only the limits
            if compression is not None or engine_options:
                raise UserError("a shared engine brings its own compression and pool: pass only scheduler_config")
            self.engine = model
        else:
            from ov_kvcrush.engines import resolve_model

            # the engine reads the pool limit (and, with cache eviction, the compression) from sc
            self.engine = OpenVINOEngine(
                resolve_model("openvino", model), compression, device, scheduler_config=sc, **engine_options
            )
        self.max_num_seqs = sc.max_num_seqs if sc is not None else DEFAULT_MAX_NUM_SEQS
        self.max_num_batched_tokens = sc.max_num_batched_tokens if sc is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS
        check_int("scheduler_config.max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        check_int("scheduler_config.max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        self.chunked = bool(sc.dynamic_split_fuse) if sc is not None else True
        e = self.engine
        self.pool = e.pool
        self.request = e.compiled.create_infer_request()  # the engine's own request stays free for it
        limits = SchedulerLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked=self.chunked,
            pool_blocks=e.max_kv_blocks,
            rows=e.shape.layers * e.shape.kv_heads,
            block_size=e.block_size,
            holds_everything=not e.compression.compresses,
            scoring_tokens=e.scoring.step_bound(),
        )
        self.scheduler = Scheduler(limits, self._free_blocks, self._release)
        self._requests: dict[int, _Request] = {}
        self._handles: dict[int, GenerationHandle] = {}
        self._next_id = 0
        self._step_lock = threading.RLock()  # one step at a time; requests are added between steps
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        #: counts over the pipeline's life: steps, decode rows, prompt chunks, preemptions, failures, ...
        #: (ragged_steps: a prompt chunk and decode tokens in one inference)
        self.stats = dict.fromkeys(
            (
                "steps",
                "decode_rows",
                "prefill_chunks",
                "ragged_steps",
                "preemptions",
                "failed",
                "waited",
                "scoring_passes",
            ),
            0,
        )
        #: set to a list to record every inference as (sequences, tokens, seconds): a prompt chunk
        #: step has more tokens than sequences (``benchmarks/serving_steps.py``); None: not recorded
        self.trace: list[tuple[int, int, float]] | None = None

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: int,
        prompt: Prompt | Sequence[int],
        generation_config: GenerationSettings | None = None,
        streamer: Streamer | None = None,
    ) -> GenerationHandle:
        """Queue a request (a prompt string, chat messages, or token ids); step to serve it."""
        settings = generation_config or GenerationSettings()
        if not isinstance(settings, GenerationSettings):
            settings = generation_settings(settings, {})
        if streamer is not None and not callable(streamer):
            raise ConfigError("streamer", streamer, "a callable taking the new text (return True to stop), or None")
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            with self._tokenizer_lock:
                ids = self.engine.encode(prompt, settings.apply_chat_template)  # type: ignore[arg-type]
        check_context(len(ids), settings.max_new_tokens, self.engine.max_context)
        with self._step_lock:
            if request_id in self._requests:
                raise ConfigError("request_id", request_id, "an id no unfinished request uses")
            slot = Slot(request_id, list(ids), settings.max_new_tokens)
            self.scheduler.add(slot)  # refuses what the pool can never hold
            rng = np.random.default_rng(settings.seed) if settings.do_sample else None
            req = _Request(slot, settings, TextStream(streamer, self._detokenize), rng)
            handle = GenerationHandle(request_id)
            self._requests[request_id], self._handles[request_id] = req, handle
            return handle

    def submit(
        self,
        prompt: Prompt | Sequence[int],
        generation_config: GenerationSettings | None = None,
        streamer: Streamer | None = None,
    ) -> GenerationHandle:
        """Queue a request from any thread; a worker thread steps until every request is done."""
        with self._step_lock:
            self._next_id += 1
            while self._next_id in self._requests:
                self._next_id += 1
            handle = self.add_request(self._next_id, prompt, generation_config, streamer)
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="ov_kvcrush-batching", daemon=True)
                self._worker.start()
        return handle

    def generate(
        self,
        prompts: Sequence[Prompt],
        generation_config: GenerationSettings | Sequence[GenerationSettings] | None = None,
        streamer: Streamer | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, all served together; a streamer needs a single prompt."""
        prompts = list(prompts)
        if not prompts:
            raise ConfigError("prompts", prompts, "a non-empty list of prompts")
        if streamer is not None and len(prompts) > 1:
            raise ConfigError("streamer", streamer, "None with several prompts (stream one request with submit)")
        configs = (
            list(generation_config)
            if isinstance(generation_config, (list, tuple))
            else [generation_config] * len(prompts)
        )
        if len(configs) != len(prompts):
            raise ConfigError("generation_config", f"{len(configs)} configs", f"one per prompt ({len(prompts)})")
        handles = [self.submit(p, c, streamer) for p, c in zip(prompts, configs, strict=True)]
        return [h.result() for h in handles]

    def has_non_finished_requests(self) -> bool:
        with self._step_lock:
            return self.scheduler.has_work

    # -- a step ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Run one step: one inference of a prompt chunk, if one is due, and the running requests' decode tokens."""
        with self._step_lock:
            for rid, req in list(self._requests.items()):
                if self._handles[rid].cancel_requested:
                    self._finish(req, GenerationStatus.CANCELLED)
            plan = self.scheduler.plan()
            self.stats["preemptions"] += len(plan.preempted)
            for slot in plan.failed:
                self._fail(self._requests[slot.request_id], slot.error)
            if plan.empty:
                return
            self.stats["steps"] += 1
            decode = [self._requests[s.request_id] for s in plan.decode]
            if plan.prefill is not None:
                self._prefill(*plan.prefill, decode)
            elif decode:
                self._decode(decode)

    def _work(self) -> None:
        while True:
            with self._worker_lock, self._step_lock:
                if not self.scheduler.has_work:
                    self._worker = None
                    return
            try:
                self.step()
            except Exception as exc:  # a bug, not a request's error: no waiter may hang on it
                with self._step_lock:
                    for req in list(self._requests.values()):
                        self._fail(req, f"the batching step failed: {type(exc).__name__}: {exc}")

    def _prefill(self, slot: Slot, n: int, decode: list[_Request]) -> None:
        """A prompt chunk of ``n`` tokens, and the decoding requests' tokens in the same inference."""
        req = self._requests[slot.request_id]
        if req.sequence is None:
            req.sequence = self.pool.new_sequence()
        if req.started is None:
            req.started = time.perf_counter()
        if slot.done == 0 and n < len(slot.tokens):
            req.sequence.set_prompt(len(slot.tokens))  # the method selects once, on the last chunk
        ids = [slot.tokens[slot.done : slot.done + n], *([r.slot.generated[-1]] for r in decode)]
        what = f"a {n}-token prompt chunk after {slot.done} tokens" + (
            f" beside a decode step of {len(decode)} sequences" if decode else ""
        )
        logits = self._infer(ids, [req, *decode], what)
        if logits is None:
            return
        req.chunks += 1
        self.stats["prefill_chunks"] += 1
        self.stats["ragged_steps"] += bool(decode)
        self.scheduler.prefilled(slot, n)
        self._decoded(decode, logits[1:])  # first: the pass below may preempt some of them
        if slot.done >= len(slot.tokens) and self._scoring_pass(req):
            self._emit(req, logits[0])

    def _scoring_pass(self, req: _Request) -> bool:
        """The method's scoring pass (KVzip) after a request's whole prompt, on that request alone,
        as the engine runs it for one sequence; other requests are preempted if the pool lacks the
        room of one pass step. False: the request failed."""
        e = self.engine
        seq = req.sequence
        assert seq is not None
        if not e.scoring.due(seq):
            return True
        preempted = self.scheduler.make_room(req.slot)
        self.stats["preemptions"] += len(preempted)
        t0 = time.perf_counter()
        try:
            e.scoring.run(self.request, seq, req.slot.tokens, 0)
        except RuntimeError as exc:
            where = f"in the scoring pass after {req.slot.done} tokens"
            self._fail(req, f"backend openvino failed {where}: {error_line(exc)}")
            return False
        req.scoring_s += time.perf_counter() - t0
        self.stats["scoring_passes"] += 1
        return True

    def _decode(self, reqs: list[_Request]) -> None:
        logits = self._infer([[r.slot.generated[-1]] for r in reqs], reqs, f"a decode step of {len(reqs)} sequences")
        if logits is not None:
            self._decoded(reqs, logits)

    def _decoded(self, reqs: list[_Request], logits: np.ndarray) -> None:
        self.stats["decode_rows"] += len(reqs)
        for r, row in zip(reqs, logits, strict=True):
            self.scheduler.decoded(r.slot)
            r.decode_batch.append(len(reqs))
            self._emit(r, row)

    def _infer(self, ids: list[list[int]], reqs: list[_Request], what: str) -> np.ndarray | None:
        """Logits ``[sequences, vocab]`` of one inference (equal token counts: one batch row each;
        otherwise one ragged row); on an engine error every request in it fails (their sequences
        are in an unknown state), no other request is touched."""
        seqs = [r.sequence for r in reqs]
        past = [r.slot.done for r in reqs]
        ragged = len({len(x) for x in ids}) > 1
        inputs = (self.engine.ragged_step_inputs if ragged else self.engine.step_inputs)(ids, seqs, past)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        try:
            infer_steps(self.request, inputs, [s.handle for s in seqs])
        except RuntimeError as exc:
            for r in reqs:
                self._fail(r, f"backend openvino failed on {what}: {error_line(exc)}")
            return None
        if self.trace is not None:
            self.trace.append((len(ids), sum(map(len, ids)), time.perf_counter() - t0))
        out = self.request.get_output_tensor(0).data
        return np.array(out[0] if ragged else out[:, -1], dtype=np.float32)

    def _emit(self, req: _Request, logits: np.ndarray) -> None:
        s = req.settings
        token = sample_token(logits, s, req.rng)
        req.stamps.append(time.perf_counter() - req.added)
        stats = req.sequence.stats()  # type: ignore[union-attr]
        req.peak_kv_bytes = max(req.peak_kv_bytes, stats.kv_bytes)
        if token in self.engine.eos_ids and not s.ignore_eos:
            self._finish(req, GenerationStatus.FINISHED)
            return
        req.slot.generated.append(token)
        self._handles[req.slot.request_id].push_token(token)
        stop = req.stream.push(req.slot.generated)
        if stop or len(req.slot.generated) >= s.max_new_tokens:
            self._finish(req, GenerationStatus.FINISHED)

    # -- ends -----------------------------------------------------------------------------------
    def _finish(self, req: _Request, status: GenerationStatus) -> None:
        self.stats["waited"] += req.slot.waited
        result = self._result(req)
        self._close(req)
        self._handles.pop(req.slot.request_id).finish(status, result)

    def _fail(self, req: _Request, error: str) -> None:
        self.stats["failed"] += 1
        self._close(req)
        self._handles.pop(req.slot.request_id).finish(GenerationStatus.FAILED, None, error)

    def _close(self, req: _Request) -> None:
        self.scheduler.finish(req.slot)
        if req.sequence is not None:
            req.sequence.free()  # its blocks go back now
            req.sequence = None
        self._requests.pop(req.slot.request_id, None)

    def _release(self, slot: Slot) -> None:
        """Preemption: the sequence's blocks go back (the scheduler starts the slot over)."""
        req = self._requests[slot.request_id]
        if req.sequence is not None:
            req.sequence.reset()

    def _free_blocks(self) -> int | None:
        """Full-precision blocks' worth of the pool not in use (2-bit blocks count by their bytes)."""
        if not self.engine.max_kv_blocks:
            return None
        st = self.pool.stats()
        return self.engine.max_kv_blocks - -(-st.kv_bytes // st.block_bytes)

    def _detokenize(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return self.engine.tokenizer.decode(tokens)

    def _result(self, req: _Request) -> GenerationResult:
        e = self.engine
        counters = e.sequence_counters(req.sequence) if req.sequence is not None else {}
        stats = req.sequence.stats() if req.sequence is not None else None
        ttft_ms, tpot_ms = ttft_tpot_ms(req.stamps)
        prompt, tokens = req.slot.prompt, req.slot.generated
        seen = len(prompt) + len(tokens)
        counters.update(
            prefill_tokens=len(prompt),
            waited_for_pool=req.slot.waited,
            waited_ms=round(((req.started or time.perf_counter()) - req.added) * 1e3, 3),
            prefill_chunks=req.chunks,
            preemptions=req.slot.preemptions,
            decode_batch_mean=round(float(np.mean(req.decode_batch)), 2) if req.decode_batch else 0.0,
        )
        if req.scoring_s:
            counters["scoring_pass_ms"] = round(req.scoring_s * 1e3, 3)
        return GenerationResult(
            text=self._detokenize(tokens) if tokens else "",
            token_ids=list(tokens),
            prompt_tokens=len(prompt),
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            step_ms=step_ms(req.stamps),
            kv_bytes=stats.kv_bytes if stats else 0,
            full_kv_bytes=e.full_kv_bytes(seen),
            peak_kv_bytes=max(req.peak_kv_bytes, stats.kv_bytes if stats else 0),
            method=e.compression.method,
            budget=e.compression.budget,
            backend="openvino",
            counters=counters,
        )
