"""Choosing the next token from logits, shared by the engines that sample on the host
(the openvino engine and the serving pipeline); the rules are the torch engine's."""

from __future__ import annotations

import numpy as np

from ov_kvcrush.config import GenerationSettings


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
