"""The openvino backend's one generation loop: continuous batching over our op, many requests,
one block pool, one inference per step.

Its API is ``openvino_genai.ContinuousBatchingPipeline``'s (what OpenVINO Model Server serves);
:class:`~ov_kvcrush.serving.pipeline.ContinuousBatchingPipeline` is this loop made from a model
path, and every ``OpenVINOEngine`` has one (``engine.batcher``)::

    pipe = ContinuousBatchingPipeline(model_dir, scheduler_config, compression=CompressionConfig("kvcrush", 1024))
    results = pipe.generate(prompts, GenerationSettings(max_new_tokens=64))      # one result per prompt

    handle = pipe.add_request(0, "question", GenerationSettings(max_new_tokens=32))
    while pipe.has_non_finished_requests():
        pipe.step()
    print(handle.result())

    handle = pipe.submit("question", streamer=print)   # from any thread: a worker thread steps
    print(handle.result())

    result = pipe.run("question")        # one request, stepped in the calling thread

``LLMPipeline`` calls, lists, threads and chat turns, and ``OpenVINOEngine.generate``, are all
requests here. A chat turn is a request that continues a sequence whose cache outlives
it (a :class:`~ov_kvcrush.engines.openvino_model.SequenceCache`): the turn keeps the prefix the
sequence holds and feeds the rest in one step.

Every step (:meth:`GenerationLoop.step`) is **one** inference: at most one prompt
chunk (the op prefills a prompt in chunks and runs the method's prompt selection once, on the
last one) side by side with the decode token of every sequence past its prompt, as native
continuous batching runs a step. The tokens go through the model's matmuls together, each
carrying its sequence's handle, and the op attends each sequence's run of tokens as that
sequence's step (:func:`ov_kvcrush.op.step_inputs.ragged_step_inputs`); a decode-only step
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
from typing import Any

import numpy as np

from ov_kvcrush.config import GenerationSettings, generation_settings
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer, TextStream, chat_messages, check_context
from ov_kvcrush.engines.openvino_model import OpenVINOModel, SequenceCache, error_line
from ov_kvcrush.engines.sampling import sample_token
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.op.step_inputs import FAST_STEP_TOKENS, fast_prompt_cut
from ov_kvcrush.serving.handle import GenerationHandle, GenerationStatus
from ov_kvcrush.serving.kept import KeptCaches, hold_prompt, keep_held, turn_cuts
from ov_kvcrush.serving.request import ServedRequest
from ov_kvcrush.serving.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    Scheduler,
    SchedulerLimits,
    Slot,
)
from ov_kvcrush.validation import check_int

# Imported where used, inside functions: what pulls in openvino_genai, heavy to import, so that
# importing this module stays light.


class GenerationLoop:
    """Serve many requests over one model's KV block pool with our op (see the module doc).

    Args:
        model: the :class:`~ov_kvcrush.engines.openvino_model.OpenVINOModel` (an
            ``OpenVINOEngine``) whose compiled model, tokenizer, compression and pool it serves.
        scheduler_config: an ``openvino_genai.SchedulerConfig``: its ``max_num_seqs``,
            ``max_num_batched_tokens`` and ``dynamic_split_fuse`` (the model took its pool and
            compression); ``None``: its defaults (``whole_prompts``: whole prompts and any number
            of sequences instead).
        whole_prompts: without a scheduler config, no limit on a step's tokens or on the
            sequences: a prompt goes in whole (in two steps, whole tiles then the rest), as one
            generation alone runs (what ``OpenVINOEngine.generate`` serves through).
    """

    def __init__(self, model: OpenVINOModel, scheduler_config: Any = None, *, whole_prompts: bool = False) -> None:
        sc = check_scheduler_config(scheduler_config)
        if not isinstance(model, OpenVINOModel):
            raise ConfigError("model", model, "an OpenVINOModel (an OpenVINOEngine)")
        self.engine = model
        unlimited = whole_prompts and sc is None
        self.max_num_seqs = sc.max_num_seqs if sc is not None else (1 << 16 if unlimited else DEFAULT_MAX_NUM_SEQS)
        self.max_num_batched_tokens = (
            sc.max_num_batched_tokens if sc is not None else (1 << 24 if unlimited else DEFAULT_MAX_NUM_BATCHED_TOKENS)
        )
        check_int("scheduler_config.max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        check_int("scheduler_config.max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        self.chunked = bool(sc.dynamic_split_fuse) if sc is not None else True
        e = self.engine
        self.pool = e.pool
        #: the most tokens a prompt's first step feeds (a held point within it keeps it fast)
        self.first_step = self.max_num_batched_tokens if self.chunked else 1 << 40
        self.request = e.new_request()  # the engine's own request stays free for it
        limits = SchedulerLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked=self.chunked,
            pool_blocks=e.max_kv_blocks,
            rows=e.shape.layers * e.shape.kv_heads,
            block_size=e.block_size,
            holds_everything=not e.compression.compresses,
            scoring_tokens=e.scoring.step_bound(),
            first_chunk=None if e.plugin is not None else fast_prompt_cut,
        )
        #: finished requests' caches kept for their conversation's next turn (the server keeps
        #: them; empty otherwise): the scheduler reclaims them before it preempts a request
        self.kept = KeptCaches(self.pool)
        self.scheduler = Scheduler(limits, self._free_blocks, self._release, self.kept.reclaim)
        self._requests: dict[int, ServedRequest] = {}
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
        *,
        cache: SequenceCache | None = None,
        question_at: int | None = None,
        turns: Sequence[int] = (),
    ) -> GenerationHandle:
        """Queue a request (a prompt string, chat messages, or token ids); step to serve it.

        ``cache``: a sequence of this pipeline's pool that outlives the request (a chat's): the
        request keeps the prefix of its tokens the sequence holds, feeds the rest in one step,
        and leaves the sequence holding what it fed. ``question_at``: the token where a question
        starts: the context before it is the method's prompt (prefilled and compressed first,
        its scoring pass included), the question is fed after it in one step. ``turns``: with a
        cache that holds prompts, the token counts of the conversation's earlier turns' prompts
        (:meth:`turn_prompts`): its chunks end where those turns held theirs, so that the
        history sent cold computes what it did continued from its turns' held prompts.
        """
        settings = generation_config or GenerationSettings()
        if not isinstance(settings, GenerationSettings):
            settings = generation_settings(settings, {})
        if streamer is not None and not callable(streamer):
            raise ConfigError("streamer", streamer, "a callable taking the new text (return True to stop), or None")
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            ids = self.encode(prompt, settings.apply_chat_template)  # type: ignore[arg-type]
        check_context(len(ids), settings.max_new_tokens, self.engine.max_context)
        if question_at is not None:
            if cache is not None:
                raise UserError("question_at is for a fresh prompt; a cache's next turn is asked after the last")
            check_int("question_at", question_at, 1, len(ids))
        with self._step_lock:
            if request_id in self._requests:
                raise ConfigError("request_id", request_id, "an id no unfinished request uses")
            if cache is not None:
                self._check_cache(cache)
            held = cache.keep_prefix(ids) if cache is not None else 0
            slot = Slot(request_id, list(ids), settings.max_new_tokens, done=held, question_at=question_at)
            if cache is not None and cache.holds_prompt:  # the prompt continues, and is held again
                slot.held_prompt = held > 0
                slot.cuts, slot.hold_at = turn_cuts(self.pool, turns, slot.prompt_end, held, self.first_step)
            self.scheduler.add(slot)  # refuses what the pool can never hold
            rng = np.random.default_rng(settings.seed) if settings.do_sample else None
            stream = TextStream(streamer, self._detokenize)
            req = ServedRequest(slot, settings, stream, rng, cache=cache, kept=cache is not None)
            if slot.hold_at and slot.hold_at == held:  # its held start is held again, as it is
                req.held, slot.hold_at = hold_prompt(cache, ids[:held]), 0  # type: ignore[arg-type]
            handle = GenerationHandle(request_id)
            self._requests[request_id], self._handles[request_id] = req, handle
            return handle

    @property
    def keeps_turns(self) -> bool:
        """Whether a conversation's cache can be kept for its next turn (:meth:`turn_cache`)."""
        return self.engine.method.keeps_later_turns or self.pool.snapshots

    def turn_cache(self) -> SequenceCache:
        """A cache for a request whose conversation's next turn continues from it (the server's):
        the full cache keeps its sequence as the turn leaves it; another method's holds the
        prompt before its selection (:mod:`ov_kvcrush.serving.kept`), where :attr:`keeps_turns`."""
        return SequenceCache(self.pool.new_sequence(), holds_prompt=not self.engine.method.keeps_later_turns)

    def _check_cache(self, cache: SequenceCache) -> None:
        if not isinstance(cache, SequenceCache) or cache.sequence is None or cache.sequence.pool is not self.pool:
            raise ConfigError("cache", cache, "a SequenceCache of a sequence of this pipeline's pool")
        if any(r.cache is cache for r in self._requests.values()):
            raise ConfigError("cache", cache, "a sequence no unfinished request uses")

    def _new_id(self) -> int:
        self._next_id += 1
        while self._next_id in self._requests:
            self._next_id += 1
        return self._next_id

    def submit(
        self,
        prompt: Prompt | Sequence[int],
        generation_config: GenerationSettings | None = None,
        streamer: Streamer | None = None,
        *,
        cache: SequenceCache | None = None,
        turns: Sequence[int] = (),
    ) -> GenerationHandle:
        """Queue a request from any thread; a worker thread steps until every request is done.
        ``cache``, ``turns``: as in :meth:`add_request`."""
        with self._step_lock:
            handle = self.add_request(self._new_id(), prompt, generation_config, streamer, cache=cache, turns=turns)
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

    def run(
        self,
        prompt: Prompt | Sequence[int],
        generation_config: GenerationSettings | None = None,
        streamer: Streamer | None = None,
        *,
        cache: SequenceCache | None = None,
        question_at: int | None = None,
    ) -> GenerationResult:
        """Serve one request, stepping in the calling thread until it ends (other threads'
        requests ride along in its steps); its result. ``cache``, ``question_at``: as in
        :meth:`add_request`. Interrupted (Ctrl-C), the request ends and its blocks go back."""
        with self._step_lock:
            handle = self.add_request(
                self._new_id(), prompt, generation_config, streamer, cache=cache, question_at=question_at
            )
        try:
            while not handle.done():
                self._step_or_fail_all()
        except BaseException:
            with self._step_lock:
                req = self._requests.get(handle.request_id)
                if req is not None:
                    self._fail(req, "interrupted")
            raise
        return handle.result()

    def warm_up(self) -> bool:
        """One short request through each kind of step a request takes (a fast prompt chunk, the
        prompt's rest, with the method's selection past its budget, and a decode step), none of it
        kept or counted in :attr:`stats`: a server's first request after a start (a restart, its
        conversations continued from disk) would otherwise pay the runtime's first-use costs
        (kernels built for their shapes, threads, memory first touched), hundreds of ms. False
        when the pool cannot hold it (nothing run)."""
        tokens = FAST_STEP_TOKENS + FAST_STEP_TOKENS // 4 + (self.engine.compression.budget or 0)
        if self.engine.max_context:
            tokens = min(tokens, self.engine.max_context - 2)
        ids = [i % 1000 for i in range(tokens)]  # ids every vocabulary has
        settings = GenerationSettings(max_new_tokens=2, ignore_eos=True, apply_chat_template=False)
        counts = dict(self.stats)
        try:
            self.generate([ids], settings)
        except UserError:
            return False
        finally:
            self.stats.update(counts)
        return True

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
            self._step_or_fail_all()

    def _step_or_fail_all(self) -> None:
        """A step; an exception in it is a bug, not a request's error: every request fails with
        it, so that no waiter hangs."""
        try:
            self.step()
        except Exception as exc:
            with self._step_lock:
                for req in list(self._requests.values()):
                    self._fail(req, f"the batching step failed: {type(exc).__name__}: {exc}")

    def _prefill(self, slot: Slot, n: int, decode: list[ServedRequest]) -> None:
        """A prompt chunk of ``n`` tokens, and the decoding requests' tokens in the same inference;
        at the method's prompt end its scoring pass, at the tokens' end the first new token."""
        req = self._requests[slot.request_id]
        if req.cache is None:
            req.cache = SequenceCache(self.pool.new_sequence())
        if req.started is None:
            req.started = time.perf_counter()
        if slot.done == slot.held_at_start and (slot.held_prompt or (slot.done == 0 and n < slot.prompt_end)):
            req.cache.sequence.set_prompt(slot.prompt_end)  # the method selects once, on the last chunk
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
        if slot.hold_at and slot.done == slot.hold_at:  # the prompt's start, before the selection
            req.held, slot.hold_at = hold_prompt(req.cache, slot.tokens[: slot.done]), 0
        self._decoded(decode, logits[1:])  # first: the pass below may preempt some of them
        if slot.done == slot.prompt_end and not self._scoring_pass(req):
            return
        if slot.done >= len(slot.tokens):
            self._emit(req, logits[0])

    def _scoring_pass(self, req: ServedRequest) -> bool:
        """The method's scoring pass (KVzip) at the end of a request's prompt (a chat turn's too),
        over the tokens its cache has not scored, on that request alone; other requests are
        preempted if the pool lacks the room of one pass step. False: the request failed."""
        e = self.engine
        cache, slot = req.cache, req.slot
        assert cache is not None
        if not e.scoring.due(cache.sequence):
            return True
        preempted = self.scheduler.make_room(slot)
        self.stats["preemptions"] += len(preempted)
        t0 = time.perf_counter()
        try:
            e.scoring.run(self.request, cache.sequence, slot.tokens[cache.scored : slot.done], cache.scored)
        except RuntimeError as exc:
            where = f"in the scoring pass after {slot.done} tokens"
            self._fail(req, f"backend openvino failed {where}: {error_line(exc)}")
            return False
        cache.scored = slot.done
        req.scoring_s += time.perf_counter() - t0
        self.stats["scoring_passes"] += 1
        return True

    def _decode(self, reqs: list[ServedRequest]) -> None:
        logits = self._infer([[r.slot.generated[-1]] for r in reqs], reqs, f"a decode step of {len(reqs)} sequences")
        if logits is not None:
            self._decoded(reqs, logits)

    def _decoded(self, reqs: list[ServedRequest], logits: np.ndarray) -> None:
        self.stats["decode_rows"] += len(reqs)
        for r, row in zip(reqs, logits, strict=True):
            self.scheduler.decoded(r.slot)
            r.decode_batch.append(len(reqs))
            self._emit(r, row)

    def _infer(self, ids: list[list[int]], reqs: list[ServedRequest], what: str) -> np.ndarray | None:
        """Logits ``[sequences, vocab]`` of one inference (equal token counts: one batch row each;
        otherwise one ragged row); on an engine error every request in it fails (their sequences
        are in an unknown state), no other request is touched."""
        seqs = [r.cache.sequence for r in reqs]  # type: ignore[union-attr]
        past = [r.slot.done for r in reqs]
        t0 = time.perf_counter()
        try:
            logits = self.engine.run_step(self.request, ids, seqs, past)
        except RuntimeError as exc:
            for r in reqs:
                self._fail(r, f"backend openvino failed on {what}: {error_line(exc)}")
            return None
        if self.trace is not None:
            self.trace.append((len(ids), sum(map(len, ids)), time.perf_counter() - t0))
        return logits

    def _emit(self, req: ServedRequest, logits: np.ndarray) -> None:
        """Sample the request's next token (the one place the openvino backend samples), stop at
        EOS, at ``max_new_tokens`` or when the streamer says so."""
        s, slot = req.settings, req.slot
        early = len(slot.generated) < s.min_new_tokens and not s.ignore_eos  # no end before min_new_tokens
        token = sample_token(logits, s, req.rng, slot.tokens[: slot.prompt_tokens], slot.generated,
                             sorted(self.engine.eos_ids) if early else ())  # fmt: skip
        req.stamps.append(time.perf_counter() - req.added)
        stats = req.cache.sequence.stats()  # type: ignore[union-attr]
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
    def _finish(self, req: ServedRequest, status: GenerationStatus) -> None:
        self.stats["waited"] += req.slot.waited
        result = req.result(self.engine, self._detokenize)
        self._close(req, kept_ids=req.slot.fed)
        self._handles.pop(req.slot.request_id).finish(status, result)

    def _fail(self, req: ServedRequest, error: str) -> None:
        self.stats["failed"] += 1
        self._close(req, kept_ids=None)  # its sequence is in an unknown state
        self._handles.pop(req.slot.request_id).finish(GenerationStatus.FAILED, None, error)

    def _close(self, req: ServedRequest, kept_ids: list[int] | None) -> None:
        """The request leaves: its own sequence is freed (its blocks go back now); a kept cache
        holds ``kept_ids`` (``None``: nothing, it is reset)."""
        self.scheduler.finish(req.slot)
        if req.cache is not None and not req.kept:
            req.cache.sequence.free()
        elif req.cache is not None and kept_ids is None:
            req.cache.reset()
        elif req.cache is not None and req.cache.holds_prompt:
            keep_held(req.cache, req.held)
        elif req.cache is not None:
            req.cache.ids = kept_ids
        req.cache = None
        self._requests.pop(req.slot.request_id, None)

    def _release(self, slot: Slot) -> None:
        """Preemption: the sequence's blocks go back (the scheduler starts the slot over)."""
        req = self._requests[slot.request_id]
        if req.cache is not None:
            req.cache.reset()

    def _free_blocks(self) -> int | None:
        """Full-precision blocks' worth of the pool not in use (2-bit blocks count by their bytes)."""
        if not self.engine.max_kv_blocks:
            return None
        st = self.pool.stats()
        return self.engine.max_kv_blocks - -(-st.kv_bytes // st.block_bytes)

    def encode(self, prompt: Prompt, apply_chat_template: bool) -> list[int]:
        """``prompt``'s token ids as a request gets them (the tokenizer is shared with the worker
        thread's streaming, under one lock)."""
        with self._tokenizer_lock:
            return self.engine.encode(prompt, apply_chat_template)

    def turn_prompts(self, prompt: Prompt, apply_chat_template: bool) -> list[int]:
        """The token counts of a chat's earlier turns' prompts: its messages before each assistant
        reply, encoded as that turn's request was (none for a string)."""
        if isinstance(prompt, str) or not apply_chat_template:
            return []
        messages = chat_messages(prompt, apply_chat_template)
        return [len(self.encode(messages[:i], True)) for i, m in enumerate(messages) if i and m["role"] == "assistant"]

    def _detokenize(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return self.engine.tokenizer.decode(tokens)


def check_scheduler_config(sc: Any) -> Any:
    """``sc`` when it is an ``openvino_genai.SchedulerConfig`` this loop can honour (or ``None``)."""
    if sc is None:
        return None
    import openvino_genai as ov_genai

    if not isinstance(sc, ov_genai.SchedulerConfig):
        raise ConfigError("scheduler_config", sc, "an openvino_genai.SchedulerConfig")
    if sc.enable_prefix_caching:
        raise ConfigError("scheduler_config.enable_prefix_caching", True, "False (not implemented by backend openvino)")
    return sc
