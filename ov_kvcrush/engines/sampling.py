"""Choosing the next token from logits: the torch engine's rules on its tensors
(:func:`pick_rows`), and the same rules on the host's arrays for the openvino engine and the
serving loop (:func:`sample_token`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.errors import ConfigError

# Imported where used, inside functions: what pulls in torch, heavy to import, so that importing
# this module stays light.

if TYPE_CHECKING:
    import torch


def pick_rows(logits: torch.Tensor, settings: GenerationSettings, gens: list[torch.Generator | None]) -> list[int]:
    """Each row's next token from ``logits`` ``[rows, vocab]``: greedy rows in one read from the
    device, sampled rows each from its own generator (a row samples as it would alone)."""
    if not settings.do_sample:
        return [int(t) for t in logits.argmax(-1).tolist()]
    return [pick_token(row, settings, gen) for row, gen in zip(logits, gens, strict=True)]


def pick_token(logits: torch.Tensor, settings: GenerationSettings, gen: torch.Generator | None) -> int:
    """Greedy argmax, or temperature / top-k / top-p sampling of one row of logits."""
    import torch

    if not settings.do_sample:
        return int(torch.argmax(logits))
    x = logits.float() / settings.temperature
    if settings.top_k:
        kth = torch.topk(x, min(settings.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > settings.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=gen))


#: the settings :func:`sample_token` applies and the torch engines' samplers do not, at their
#: neutral values: those engines refuse them by name (:func:`refuse_host_sampler_settings`)
HOST_SAMPLER_SETTINGS = {
    "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0,
}  # fmt: skip


def refuse_host_sampler_settings(settings: GenerationSettings, backend: str) -> None:
    """Raise :class:`~ov_kvcrush.errors.ConfigError` naming the first of
    :data:`HOST_SAMPLER_SETTINGS` that ``settings`` sets: ``backend`` does not apply it."""
    values = asdict(settings)
    for name, neutral in HOST_SAMPLER_SETTINGS.items():
        if values[name] != neutral:
            raise ConfigError(
                name, values[name], f"{neutral} on backend {backend} (backends openvino and genai apply it)"
            )


def sample_token(
    logits: np.ndarray,
    settings: GenerationSettings,
    rng: np.random.Generator | None,
    prompt: Sequence[int] = (),
    generated: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> int:
    """The next token: greedy argmax, or a draw from :func:`sampling_probs`, of the logits after
    :func:`adjusted_logits` (the penalties over ``prompt`` and ``generated``, ``banned`` out)."""
    x = adjusted_logits(logits, settings, prompt, generated, banned)
    if not settings.do_sample:
        return int(np.argmax(x))
    p = sampling_probs(x, settings)
    assert rng is not None
    return int(rng.choice(p.size, p=p))


def adjusted_logits(
    logits: np.ndarray,
    settings: GenerationSettings,
    prompt: Sequence[int] = (),
    generated: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> np.ndarray:
    """The logits (float64) after the penalties, greedy or sampled: the repetition penalty over
    every token of the prompt and the answer (transformers' and openvino_genai's rule: a positive
    logit divided by it, a negative one multiplied), then OpenAI's frequency and presence
    penalties over the answer's tokens (less ``frequency_penalty`` per occurrence and
    ``presence_penalty`` once); ``banned`` tokens (end-of-sequence before ``min_new_tokens``) at -inf."""
    x = logits.astype(np.float64)  # a copy: the caller's logits stay as they are
    if settings.repetition_penalty != 1.0 and (len(prompt) or len(generated)):
        seen = np.unique(np.concatenate([np.asarray(prompt, np.int64), np.asarray(generated, np.int64)]))
        v = x[seen]
        x[seen] = np.where(v > 0, v / settings.repetition_penalty, v * settings.repetition_penalty)
    if (settings.frequency_penalty or settings.presence_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        x[ids] -= counts * settings.frequency_penalty + settings.presence_penalty
    if len(banned):
        x[np.asarray(banned, np.int64)] = -np.inf
    return x


def sampling_probs(x: np.ndarray, settings: GenerationSettings) -> np.ndarray:
    """The distribution a sampled token is drawn from (the torch engine's rules, in
    transformers' order): ``x`` over the temperature, then top-k, top-p and min-p."""
    x = x / settings.temperature
    if settings.top_k:
        k = min(settings.top_k, x.size)
        kth = np.partition(x, -k)[-k]
        x = np.where(x < kth, -np.inf, x)
    if settings.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        sx = x[order]
        p = np.exp(sx - sx[0])
        p /= p.sum()
        drop = np.cumsum(p) - p > settings.top_p  # keep the smallest prefix reaching top_p
        sx[drop] = -np.inf
        x = np.empty_like(x)
        x[order] = sx
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if settings.min_p:  # tokens less likely than min_p times the likeliest go
        p = np.where(p < settings.min_p * p.max(), 0.0, p)
        p /= p.sum()
    return p
