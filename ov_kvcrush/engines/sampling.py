"""Choosing the next token from logits: the torch engine's rules on its tensors
(:func:`pick_rows`), and the same rules on the host's arrays for the openvino engine and the
serving loop (:func:`sample_token`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ov_kvcrush.config import GenerationSettings

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


def sample_token(logits: np.ndarray, settings: GenerationSettings, rng: np.random.Generator | None) -> int:
    """Greedy argmax, or temperature / top-k / top-p sampling (the torch engine's rules)."""
    if not settings.do_sample:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / settings.temperature
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
    assert rng is not None
    return int(rng.choice(p.size, p=p))
