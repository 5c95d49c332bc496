"""``LLMPipeline``: the one user-facing generation API, shaped like ``openvino_genai.LLMPipeline``.

Users of openvino_genai change a constructor argument, not their code::

    # before
    pipe = openvino_genai.LLMPipeline(model_dir, "CPU")
    print(pipe.generate("question", max_new_tokens=32))

    # after
    pipe = ov_kvcrush.LLMPipeline(model_dir, "CPU", backend="torch",
                                  compression=CompressionConfig(method="kvcrush", budget=256))
    result = pipe.generate("question", max_new_tokens=32)
    print(result)                      # the text, like openvino_genai's DecodedResults
    print(result.kv_bytes, result.tpot_ms, result.counters)

``generate`` takes a string (the chat template is applied, as openvino_genai does), a list of
chat messages, or a list of strings (one result each), plus either a
:class:`~ov_kvcrush.config.GenerationSettings` or its fields as keyword arguments, and an
optional streamer called with each new piece of text (return ``True`` to stop).

``start_chat()`` / ``finish_chat()`` work as in openvino_genai: between them each ``generate``
is one user turn (:class:`~ov_kvcrush.serving.chat.Chat` holds the conversation). The ``openvino``
backend keeps the KV cache across turns and feeds only the new tokens; the other backends are
given the whole conversation at every turn (same answers, more prefill).

On the ``openvino`` backend every call is a request of one loop, the engine's
:class:`~ov_kvcrush.serving.loop.GenerationLoop`: single prompts, lists, calls from
several threads and chat turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ov_kvcrush.config import CompressionConfig, GenerationSettings, generation_settings
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer
from ov_kvcrush.engines.scheduler_config import compression_from_scheduler_config
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.serving.backends import backend_info, make_engine, resolve_model
from ov_kvcrush.serving.chat import Answer, Chat
from ov_kvcrush.serving.request_queue import RequestQueue


def check_inputs(inputs: Any) -> None:
    """A prompt string, chat messages (``{'role', 'content'}`` dicts) or a list of prompt strings."""
    ok = isinstance(inputs, str) or (
        isinstance(inputs, (list, tuple))
        and inputs
        and (all(isinstance(p, str) for p in inputs) or all(isinstance(m, Mapping) for m in inputs))
    )
    if not ok:
        shown = inputs if not isinstance(inputs, (list, tuple)) else f"a {type(inputs).__name__} of {len(inputs)}"
        raise ConfigError(
            "inputs", shown, "a prompt string, chat messages ({'role', 'content'} dicts) or a list of prompt strings"
        )


class LLMPipeline:
    """Generate text with KV-cache compression on any engine.

    Args:
        model: model path for the backend (an exported IR directory for ``genai`` and
            ``openvino``; an HF checkpoint or a GGUF file for ``torch``); ``None``: the embedded
            SmolLM2-135M.
        device: ``CPU`` (default); ``cuda`` for the torch backend on a GPU.
        backend: ``genai`` (native openvino_genai, default), ``openvino`` (the exported IR with
            our paged-attention op) or ``torch``.
        compression: a :class:`CompressionConfig`, or a method name (``"full"`` needs no budget).
        budget: shortcut for ``CompressionConfig(method=compression, budget=budget)``.
        **engine_options: passed to the engine (``dtype`` for torch, ``properties`` for genai and
            openvino; ``kv_precision``, ``block_size``, ``max_kv_blocks`` and
            ``scheduler_config`` — an ``openvino_genai.SchedulerConfig`` — for openvino).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "CPU",
        *,
        backend: str = "genai",
        compression: CompressionConfig | str | None = None,
        budget: int | None = None,
        **engine_options: Any,
    ) -> None:
        scheduler_config = engine_options.get("scheduler_config")
        if scheduler_config is not None:
            # openvino_genai's way of configuring the cache: the compression and (openvino) the pool limit
            if compression is not None or budget is not None:
                raise UserError("pass either scheduler_config or compression/budget, not both")
            if "scheduler_config" not in backend_info(backend).options():  # the compression it describes
                compression = compression_from_scheduler_config(engine_options.pop("scheduler_config"))
        elif compression is None or isinstance(compression, str):
            compression = CompressionConfig(method=compression or "full", budget=budget)
        elif budget is not None:
            raise UserError("pass budget inside the CompressionConfig, not beside it")
        if compression is not None and not isinstance(compression, CompressionConfig):
            raise ConfigError("compression", compression, "a CompressionConfig or a method name")
        self.backend = backend
        self.engine = make_engine(backend, resolve_model(backend, model), compression, device, **engine_options)
        self.compression: CompressionConfig = self.engine.compression
        self._chat: Chat | None = None  # the conversation while one is open
        #: calls from several threads take turns, in arrival order (request_queue.py)
        self.requests = RequestQueue()

    # -- chat -----------------------------------------------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        """Start a conversation: each later ``generate(str)`` is a user turn answered in context."""
        with self.requests.turn():
            self._start_chat(system_message)

    def _start_chat(self, system_message: str) -> None:
        self._forget_chat_cache()
        self._chat = Chat(self._chat_answer(), system_message)

    def _chat_answer(self) -> Answer:
        """How a turn is answered: an engine that keeps a chat's cache continues the sequence
        holding the conversation; the others are given the whole conversation."""
        if self.engine.capabilities.keeps_chat_cache:
            return self.engine.generate_in_cache
        return self.engine.generate

    def _forget_chat_cache(self) -> None:
        if self.engine.capabilities.keeps_chat_cache:
            self.engine.cache.reset()  # its blocks go back

    def finish_chat(self) -> None:
        """End the conversation (and free the cache it kept)."""
        with self.requests.turn():
            self._chat = None
            self._forget_chat_cache()

    def save_chat(self, path: str | Path) -> int:
        """Write the open conversation to ``path`` (atomically: a crash leaves the previous file or
        none, never half of one): its messages and, on the openvino backend, the compressed cache
        that holds it, as the op stores it (``ov_kvcrush/serving/persist.py``). Returns the bytes
        written."""
        from ov_kvcrush.serving.persist import FORMAT_VERSION, save_cache  # where used: it loads the op

        with self.requests.turn():
            if self._chat is None:
                raise UserError("save_chat needs an open chat (start_chat)")
            cached = self.engine.capabilities.keeps_chat_cache
            identity = self._chat_file_identity() if cached else {"format": FORMAT_VERSION, "model": "", "pool": None}
            cache = self.engine.cache if cached and self.engine.cache.ids else None
            return save_cache(Path(path), cache, identity, extra={"messages": self._chat.history})

    def load_chat(self, path: str | Path) -> bool:
        """Continue the conversation :meth:`save_chat` wrote to ``path`` (an open chat is replaced):
        its messages always, and its cache where the file's model and pool are this pipeline's;
        otherwise the next turn prefills the conversation (the same answers, later). Returns
        whether the cache was restored. A file that is not whole (truncated, corrupt, failing its
        checksum) or of another format version is refused, and nothing changes."""
        from ov_kvcrush.op.plugin import PluginError
        from ov_kvcrush.serving.persist import CacheFileError, read_file, restore_into

        try:
            meta, members = read_file(Path(path))
        except (CacheFileError, OSError) as e:
            raise UserError(f"load_chat: {path} is not a conversation this version can continue ({e})") from e
        messages = meta.get("extra", {}).get("messages")
        if not isinstance(messages, list):
            raise UserError(f"load_chat: {path} holds no conversation")
        with self.requests.turn():
            self._start_chat("")
            assert self._chat is not None
            self._chat.replace(messages)
            if not self.engine.capabilities.keeps_chat_cache or "ids" not in members:
                return False
            try:
                identity = self._chat_file_identity()
                self.engine.cache = restore_into(Path(path), meta, members, self.engine.cache.sequence, identity)
            except (CacheFileError, UserError, PluginError):
                self.engine.cache.reset()  # the next turn prefills the conversation
                return False
            return True

    def _chat_file_identity(self) -> dict[str, Any]:
        from ov_kvcrush.serving.persist import identity_of

        return identity_of(self.engine.model_dir, self.engine.pool)

    @property
    def chat_history(self) -> list[dict] | None:
        """The conversation so far (``None`` outside a chat)."""
        return None if self._chat is None else self._chat.history

    def fit_chat(self, message: str, max_new_tokens: int) -> int:
        """Drop the oldest turns (the system message stays) until ``message`` and ``max_new_tokens``
        fit the model's context after the conversation; returns how many turns were dropped.

        The model's positions bound a conversation whatever the cache holds: a compressed cache
        holds fewer tokens, but every token still takes a position. A message that does not fit
        even alone is left for :meth:`generate` to refuse, naming the context.
        """
        history = self.chat_history
        if history is None:
            raise UserError("fit_chat needs an open chat (start_chat)")
        limit = getattr(self.engine, "max_context", 0)
        if not limit:
            return 0
        system = history[:1] if history and history[0].get("role") == "system" else []
        turns = history[len(system) :]
        dropped = 0
        while turns:
            messages = [*system, *turns, {"role": "user", "content": message}]
            if len(self.engine.encode(messages)) + max_new_tokens <= limit:
                break
            answered = len(turns) > 1 and turns[1].get("role") == "assistant"
            turns = turns[2:] if answered else turns[1:]
            dropped += 1
        if dropped:
            assert self._chat is not None
            self._chat.replace([*system, *turns])  # the next turn keeps the cached prefix they share
        return dropped

    def generate(
        self,
        inputs: Prompt | Sequence[str],
        generation_config: GenerationSettings | None = None,
        streamer: Streamer | None = None,
        **kwargs: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (or each of a list of prompts, one after another).

        Keyword arguments override fields of ``generation_config`` (``max_new_tokens``,
        ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``apply_chat_template``).
        Backend openvino serves a list of prompts, and calls from several threads, in one
        continuous batch over one block pool (:mod:`ov_kvcrush.serving.loop`, which also serves its
        chat turns, one at a time); the other backends serve calls one at a time, in arrival order.
        Each call gets the result it would get alone (greedy; for a batch at f32 inference
        precision, see ``ov_kvcrush.serving.loop``).
        """
        settings = generation_settings(generation_config, kwargs)
        if streamer is not None and not callable(streamer):
            raise ConfigError("streamer", streamer, "a callable taking the new text (return True to stop), or None")
        check_inputs(inputs)
        batcher = self.batcher
        if batcher is not None and self._chat is None:
            # backend openvino: requests from every thread join one continuous batch
            if isinstance(inputs, (list, tuple)) and all(isinstance(p, str) for p in inputs):
                if streamer is None:
                    return batcher.generate(list(inputs), settings)
                return [batcher.submit(p, settings, streamer).result() for p in inputs]
            return batcher.submit(inputs, settings, streamer).result()
        with self.requests.turn():
            return self._generate(inputs, settings, streamer)

    @property
    def batcher(self) -> Any:
        """The engine's :class:`~ov_kvcrush.serving.loop.GenerationLoop` that serves ``generate``
        outside a chat, where it batches (backend openvino; made on first use), else ``None``."""
        return self.engine.batcher if self.engine.capabilities.batches else None

    def _generate(
        self, inputs: Prompt | Sequence[str], settings: GenerationSettings, streamer: Streamer | None
    ) -> GenerationResult | list[GenerationResult]:
        if self._chat is not None:
            return self._chat.turn(inputs, settings, streamer)  # type: ignore[arg-type]
        if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(p, str) for p in inputs):
            return [self.engine.generate(p, settings, streamer) for p in inputs]
        return self.engine.generate(inputs, settings, streamer)  # type: ignore[arg-type]
