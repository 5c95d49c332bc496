"""What every engine shares: the result type, the prompt and streamer types, and prompt validation."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ov_kvcrush.engines.model_family import sliding_context, text_config
from ov_kvcrush.errors import UserError

# Imported where used, inside functions: what pulls in numpy, heavy to import, so that importing
# this module stays light.

#: A prompt: plain text (the chat template is applied by default) or chat messages.
Prompt = str | Sequence[dict]
#: Called with each decoded text chunk; return True to stop generation early.
Streamer = Callable[[str], bool | None]


def chat_messages(prompt: Prompt, apply_chat_template: bool = True) -> list[dict] | None:
    """The messages an engine formats with the chat template, or ``None`` for raw text.

    A string becomes one user message (as openvino_genai does) unless ``apply_chat_template`` is
    off; messages must be a non-empty list of ``{'role', 'content'}`` dicts. Bad prompts raise
    :class:`~ov_kvcrush.errors.UserError`, the same in every engine.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise UserError("prompt is empty")
        return [{"role": "user", "content": prompt}] if apply_chat_template else None
    messages = list(prompt)
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise UserError("prompt messages must be a non-empty list of {'role', 'content'} dicts")
    return messages


class TextStream:
    """Hands a streamer the new text each time tokens are added.

    The whole token list is decoded every time, so a character spread over several tokens is sent
    once it is complete, never half.
    """

    def __init__(self, streamer: Streamer | None, decode: Callable[[list[int]], str]) -> None:
        self.streamer = streamer
        self.decode = decode
        self.sent = ""

    def push(self, tokens: list[int]) -> bool:
        """Send what ``tokens`` add to the text so far; ``True`` when the streamer asks to stop."""
        if self.streamer is None:
            return False
        text = self.decode(tokens)
        stop = len(text) > len(self.sent) and bool(self.streamer(text[len(self.sent) :]))
        self.sent = text
        return stop


def equal_length_groups(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of ``rows`` grouped by length (groups in order of first appearance): the batches
    a generation runs without padding."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(len(row), []).append(i)
    return list(groups.values())


def ttft_tpot_ms(stamps: Sequence[float]) -> tuple[float, float]:
    """TTFT and TPOT in ms from the seconds at which each new token was ready (0 if none / one)."""
    ttft = stamps[0] if stamps else 0.0
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return ttft * 1e3, tpot * 1e3


def step_ms(stamps: Sequence[float]) -> list[float]:
    """The decode steps' durations in ms (between consecutive new tokens): for medians and p90."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


def model_context(model: str | Path) -> int:
    """The context of the model at ``model``, in tokens (0 when it does not say): the
    ``max_position_embeddings`` of its ``config.json`` (its text config's, for a multimodal
    model), as exported IRs and HF checkpoints carry it, or a GGUF file's ``<arch>.context_length``.

    Every engine reads its limit here and checks requests with :func:`check_context`, so the
    three backends refuse the same requests.
    """
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from ov_kvcrush.models.gguf_metadata import context_length

        try:
            return context_length(path)
        except (ValueError, OSError):  # not GGUF, or cut short: the engine that loads it says so
            return 0
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    context = int(text_config(cfg).get("max_position_embeddings") or 0)
    window = sliding_context(cfg)  # every layer slides: exact only within the window
    return min(context, window) if context and window else context or window


#: stands for a user message's content while the chat template is rendered around it
_CONTENT_MARK = "@@ov-kvcrush-content@@"


def generation_prefix(render: Callable[[list[dict]], str] | None, encode: Callable[[str], list[int]]) -> list[int]:
    """The ids a chat template puts between a user message's content and the answer (SmolLM2:
    ``<|im_end|>\n<|im_start|>assistant\n``): what a scoring pass puts before the text the model
    is asked to repeat (:attr:`~ov_kvcrush.methods.MethodConfig.scoring_pass`). ``render`` applies
    the template with the generation prompt (``None``: no template, a newline as kvpress uses)."""
    if render is None:
        return encode("\n")
    text = render([{"role": "user", "content": _CONTENT_MARK}])
    if _CONTENT_MARK not in text:
        return encode("\n")
    return encode(text.split(_CONTENT_MARK, 1)[1])


def question_split(ids: Sequence[int], context_ids: Sequence[int]) -> int:
    """Tokens of the prompt ``ids`` that come before its question: the common prefix with
    ``context_ids`` (the same prompt without the question, templated the same way), less one
    token, so a token that the question's first characters merged into stays with the question.
    At least one token stays on each side."""
    common = 0
    limit = min(len(ids), len(context_ids))
    while common < limit and ids[common] == context_ids[common]:
        common += 1
    if len(ids) < 2:
        raise UserError("a prompt asked after its context needs at least 2 tokens")
    return max(1, min(common - 1, len(ids) - 1))


def context_prompt(prompt: Prompt, question: str) -> Prompt:
    """``prompt`` without its trailing ``question`` (the context a cache compresses before the
    question is seen); a string prompt, or messages whose last one is the user's."""
    if not question:
        raise UserError("question is empty: --question-after needs samples that say their question")
    if isinstance(prompt, str):
        if not prompt.endswith(question) or prompt == question:
            raise UserError("the prompt does not end with its question (needed to ask it after the context)")
        return prompt[: -len(question)]
    messages = [dict(m) for m in prompt]
    last = messages[-1]["content"] if messages else ""
    if not isinstance(last, str) or not last.endswith(question) or last == question:
        raise UserError("the last message does not end with the question (needed to ask it after the context)")
    messages[-1]["content"] = last[: -len(question)]
    return messages


def check_context(prompt_tokens: int, new_tokens: int, limit: int | None, name: str = "max_new_tokens") -> None:
    """Refuse a request longer than the model's context (``limit``; ``None``/0: unknown, no check),
    naming the token limit as its caller's user gave it (``name``: the server's ``max_tokens``)."""
    if limit and prompt_tokens + new_tokens > limit:
        raise UserError(
            f"prompt ({prompt_tokens} tokens) + {name} ({new_tokens}) exceeds the model's context of {limit} tokens"
        )


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by each engine class (its ``capabilities``): callers ask the
    engine, never its backend's name.

    Attributes:
        switches_compression: ``set_compression`` switches the method in place (native
            ``openvino_genai`` fixes it per pipeline: a new engine per configuration).
        shares_prompt: ``generate_each`` fills every configuration's cache from one pass over the
            prompt (the evaluations' grid at the cost of one prefill).
        asks_question_after: ``generate(..., question=)`` compresses the context, then asks.
        keeps_chat_cache: ``generate_in_cache`` continues the sequence that holds the
            conversation (a chat turn prefills only what is new); else each turn is the whole
            conversation.
        batches: a continuous-batching loop serves its requests (``batcher``).
        tracks_recall: the recall methods measure their top-budget recall against the model's
            real attention at every step.
        scores_continuations: ``score_continuation_each`` (perplexity) runs.
        solves_kv_bytes: a budget can be solved for a target of KV bytes (equal memory): by the
            reference's caches, or by our op's probe.
        measures_held_bytes: the bytes a configuration holds are measured without the model
            (our op's probe: the equal-memory budgets are solved on it).
        takes_method_options: a method's own options apply (native eviction has its own settings).
    """

    switches_compression: bool = True
    shares_prompt: bool = False
    asks_question_after: bool = False
    keeps_chat_cache: bool = False
    batches: bool = False
    tracks_recall: bool = False
    scores_continuations: bool = False
    solves_kv_bytes: bool = False
    measures_held_bytes: bool = False
    takes_method_options: bool = True


@dataclass
class GenerationResult:
    """One generation and what it cost.

    ``kv_bytes`` is what the KV cache really holds at the end of generation, in the precision the
    engine stores it (block granularity for paged engines); ``full_kv_bytes`` is what the
    uncompressed cache would hold for the same sequence in the same precision;
    ``peak_kv_bytes`` is the most it held at any step (native eviction holds the whole prompt
    during prefill before evicting).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_ms: float
    tpot_ms: float
    kv_bytes: int
    full_kv_bytes: int
    peak_kv_bytes: int
    method: str
    budget: int | None
    backend: str
    counters: dict[str, Any] = field(default_factory=dict)
    #: each decode step's duration in ms (their mean is ``tpot_ms``)
    step_ms: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        # Prints as its text, like openvino_genai's DecodedResults.
        return self.text

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["generated_tokens"] = self.generated_tokens
        d["kv_ratio"] = self.kv_ratio
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
