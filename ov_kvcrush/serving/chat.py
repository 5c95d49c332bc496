"""A conversation over any engine: its messages, in one place, and how a turn is answered.

``LLMPipeline.start_chat`` and ``OpenVINOEngine.start_chat`` both hold one. What answers a turn
is the engine's: the openvino backend continues the sequence that holds the conversation so far
(:meth:`~ov_kvcrush.serving.openvino_engine.OpenVINOEngine.generate_in_cache`); the other
backends are given the whole conversation (same answers, more prefill).
"""

from __future__ import annotations

from collections.abc import Callable

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.engines.base import GenerationResult, Streamer
from ov_kvcrush.errors import UserError

#: What a chat compresses with when only a budget is given (``ov-kvcrush chat``, ``ov-kvcrush
#: serve``): a later question needs what an earlier turn holds, and KVzip scores a turn by
#: reconstructing it, not by the queries seen so far (issue 25: 6/6 needles asked in the next turn
#: where SnapKV and KVCrush answered 0/6).
CHAT_METHOD = "kvzip"


def chat_method(method: str | None, budget: int | None) -> str:
    """The method a chat runs: ``method``, else :data:`CHAT_METHOD` with a budget, else full."""
    return method or (CHAT_METHOD if budget is not None else "full")


#: answers a conversation (its messages, the last a user's) as one generation
Answer = Callable[[list[dict], GenerationSettings, Streamer | None], GenerationResult]


class Chat:
    """One conversation: the system message, then user and assistant turns."""

    def __init__(self, answer: Answer, system_message: str = "") -> None:
        self.answer = answer
        self._messages: list[dict] = [{"role": "system", "content": system_message}] if system_message else []

    @property
    def history(self) -> list[dict]:
        """The conversation so far (a copy)."""
        return [dict(m) for m in self._messages]

    def replace(self, messages: list[dict]) -> None:
        """Go on from ``messages`` instead (e.g. without the oldest turns)."""
        self._messages = [dict(m) for m in messages]

    def turn(self, message: str, settings: GenerationSettings, streamer: Streamer | None) -> GenerationResult:
        """Answer the user's ``message`` in context; the answer joins the conversation."""
        if not isinstance(message, str):
            raise UserError("in a chat, generate takes the user's message as a string")
        asked = [*self._messages, {"role": "user", "content": message}]
        result = self.answer(asked, settings, streamer)
        self._messages = [*asked, {"role": "assistant", "content": result.text}]
        return result


__all__ = ["Answer", "Chat"]
