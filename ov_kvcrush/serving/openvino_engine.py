"""OpenVINO engine: the exported IR with our paged-attention op, on CPU, generating through the
one loop.

The model, its block pool and one step are :class:`~ov_kvcrush.engines.openvino_model.OpenVINOModel`'s;
generating is the continuous-batching loop's (:class:`~ov_kvcrush.serving.loop.GenerationLoop`,
one per engine, made on first use): a single prompt, a chat turn and a batch of
``LLMPipeline`` calls are requests there, sampled, stopped, streamed and measured in one place.
Everything else (weights, matmuls, RoPE) is OpenVINO's, so this engine runs at the speed of the
plugin plus our attention.

Metrics as in :class:`~ov_kvcrush.engines.base.GenerationResult`: ``kv_bytes`` is the blocks the
sequence holds (all layers, K and V) × bytes per block, read from the extension after each step;
``full_kv_bytes`` is what a full cache in the same precision and block size holds for the tokens
fed.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.base import (
    Capabilities,
    GenerationResult,
    Prompt,
    Streamer,
    context_prompt,
    question_split,
)
from ov_kvcrush.engines.openvino_model import OpenVINOModel
from ov_kvcrush.errors import UserError
from ov_kvcrush.serving.chat import Chat
from ov_kvcrush.serving.loop import GenerationLoop


class OpenVINOEngine(OpenVINOModel):
    """Generate with the exported IR whose attention is our paged-attention op.

    Takes :class:`~ov_kvcrush.engines.openvino_model.OpenVINOModel`'s arguments (the model
    directory, the compression, the KV precision, block size and pool limit, a scheduler config,
    OpenVINO properties). Its ``scheduler_config`` also limits the steps of its loop; without
    one, a prompt goes in whole (as one generation alone runs).
    """

    backend = "openvino"
    capabilities: ClassVar[Capabilities] = Capabilities(
        asks_question_after=True, keeps_chat_cache=True, batches=True, solves_kv_bytes=True, measures_held_bytes=True
    )
    #: the conversation while one is open
    chat: Chat | None = None
    _batcher: GenerationLoop | None = None
    _batcher_lock = threading.Lock()  # makes any engine's loop once (the constructor is the model's)

    @property
    def batcher(self) -> GenerationLoop:
        """The continuous-batching loop over this engine's model and pool (made on first use)."""
        with self._batcher_lock:
            if self._batcher is None:
                self._batcher = GenerationLoop(self, self.scheduler_config, whole_prompts=True)
            return self._batcher

    def set_compression(self, compression: CompressionConfig) -> None:
        """Switch method and budget for the next generations: a new pool (and loop over it), the
        model stays compiled (an evaluation compares many methods on one engine). Closes an open
        chat."""
        self.chat = None
        super().set_compression(compression)
        with self._batcher_lock:
            self._batcher = None  # it served the previous pool

    # -- chat -----------------------------------------------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        """Open a conversation: later ``generate`` calls add turns and keep the cache across them."""
        self.cache.reset()
        self.chat = Chat(self.generate_in_cache, system_message)

    def finish_chat(self) -> None:
        """Close the conversation and free its cache."""
        self.chat = None
        self.cache.reset()

    @property
    def chat_history(self) -> list[dict] | None:
        return None if self.chat is None else self.chat.history

    def set_chat_history(self, messages: list[dict]) -> None:
        """Replace the open conversation (e.g. without its oldest turns): the next turn keeps the
        cached prefix the new conversation shares and prefills the rest."""
        if self.chat is None:
            raise UserError("set_chat_history needs an open chat (start_chat)")
        self.chat.replace(messages)

    def generate_in_cache(
        self, messages: list[dict], settings: GenerationSettings, streamer: Streamer | None = None
    ) -> GenerationResult:
        """A chat turn: ``messages`` (the conversation, the last a user's) continue the engine's own
        sequence, which keeps the prefix of them it holds and is fed the rest."""
        return self.batcher.run(self.encode(messages), settings, streamer, cache=self.cache)

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        streamer: Streamer | None = None,
        question: str | None = None,
    ) -> GenerationResult:
        """Generate for one prompt (one chat turn while a chat is open).

        ``question`` (outside a chat): the text ``prompt`` ends with; the context before it is
        prefilled and compressed first (the method's prompt selection, KVzip's scoring pass), then
        the question is fed as the next step, as a later chat turn would be.
        """
        settings = settings or GenerationSettings()
        if self.chat is not None:
            if question is not None:
                raise UserError("question is for a single prompt; in a chat, the next turn is asked after the last")
            return self.chat.turn(prompt, settings, streamer)  # type: ignore[arg-type]
        ids = self.encode(prompt, settings.apply_chat_template)
        question_at = None
        if question is not None:
            context_ids = self.encode(context_prompt(prompt, question), settings.apply_chat_template)
            question_at = question_split(ids, context_ids)
        return self.batcher.run(ids, settings, streamer, question_at=question_at)


__all__ = ["OpenVINOEngine"]
