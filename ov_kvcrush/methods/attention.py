"""The reference attention every method attends with, and the input checks of its tensors.

Tensors follow one layout everywhere (the layout transformers uses inside attention):

* keys / values ``[batch, kv_heads, tokens, head_dim]`` (keys after RoPE, so a kept key needs no
  position to be re-applied),
* queries ``[batch, q_heads, q_tokens, head_dim]`` with ``q_heads`` a multiple of ``kv_heads``
  (grouped-query attention: query head ``j`` reads KV head ``j // (q_heads // kv_heads)``),
* per-head statistics ``[batch, heads, tokens]``.

:func:`attend` is exact (float32 whatever the input dtype) and is the oracle the op's kernels
and any fast path are tested against. Nothing here is CPU-specific: every tensor is created on
the device of the inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ov_kvcrush.errors import UserError


class ShapeError(UserError):
    """A tensor handed to a method has the wrong rank, size or dtype; the message names it."""


def check_kv(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Reject keys/values that are not matching ``[batch, kv_heads, tokens, head_dim]`` float tensors."""
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must be [batch, kv_heads, tokens, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ShapeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if keys.shape[:3] != values.shape[:3]:
        raise ShapeError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in batch/heads/tokens")
    if keys.shape[0] == 0 or keys.shape[1] == 0 or keys.shape[2] == 0 or keys.shape[3] == 0:
        raise ShapeError(
            f"keys must have at least one batch row, head, token and channel, got shape {tuple(keys.shape)}"
        )


def check_query(queries: torch.Tensor, keys: torch.Tensor) -> int:
    """Check ``queries`` against ``keys``; return the GQA group size (query heads per KV head)."""
    if not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        shape = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries).__name__
        raise ShapeError(f"queries must be [batch, q_heads, q_tokens, head_dim], got {shape}")
    if queries.shape[0] != keys.shape[0] or queries.shape[3] != keys.shape[3]:
        raise ShapeError(f"queries {tuple(queries.shape)} do not match keys {tuple(keys.shape)} in batch/head_dim")
    hq, hk = queries.shape[1], keys.shape[1]
    if hq == 0 or hq % hk:
        raise ShapeError(f"q_heads={hq} must be a positive multiple of kv_heads={hk}")
    return hq // hk


def check_scores(scores: torch.Tensor, name: str = "scores", dims: int = 3) -> None:
    """Reject per-head statistics that are not a ``dims``-rank float tensor."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != dims or not scores.is_floating_point():
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ShapeError(f"{name} must be a float tensor of rank {dims}, got {shape}")


#: Largest ``[batch, q_heads, q_chunk, keys]`` logits block :func:`attend` materialises at once
#: (64 Mi floats = 256 MiB in float32); longer prompts are split into query chunks.
ATTEND_CHUNK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class LogitMap:
    """How a model turns ``q·k`` into the logit its softmax takes: times ``scale`` (``None``:
    ``1/sqrt(head_dim)``), then ``softcap * tanh(s / softcap)`` when ``softcap`` is set (Gemma 2;
    :func:`cap_logits`). The op's attributes of the same names (``LogitMap`` in its kernels)."""

    scale: float | None = None
    softcap: float | None = None


def group_heads(per_q_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a ``[batch, q_heads, ...]`` statistic over each KV head's query group -> ``[batch, kv_heads, ...]``."""
    b, hq = per_q_head.shape[:2]
    return per_q_head.reshape(b, kv_heads, hq // kv_heads, *per_q_head.shape[2:]).sum(dim=2)


@dataclass
class AttentionOutput:
    """Result of :func:`attend`.

    Attributes:
        output: ``[batch, q_heads, q_tokens, head_dim]`` in the query dtype.
        scores: ``[batch, q_heads, keys]`` attention probabilities summed over the query tokens
            (the per-head cumulative scores of MiniKV's selective flash attention), float32; ``None``
            unless asked for.
    """

    output: torch.Tensor
    scores: torch.Tensor | None = None


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    return_scores: bool = False,
    softcap: float | None = None,
) -> AttentionOutput:
    """Exact softmax attention with GQA, an optional causal mask, additive bias and key mask.

    Args:
        queries: ``[b, hq, t, d]``.
        keys, values: ``[b, hk, n, d]``.
        q_positions: ``[t]`` absolute positions of the queries; with ``k_positions`` it makes the
            attention causal (a key at a later position than the query is masked).
        k_positions: ``[b, hk, n]`` (or ``[n]``) absolute positions of the keys; after eviction they
            differ per head.
        bias: ``[b, hk, n]`` added to every logit of that key (Chelsea's ``log(degree)``).
        key_mask: ``[b, hk, n]`` bool, ``False`` for padding slots.
        scale: logit scale; ``1/sqrt(head_dim)`` by default (models pass their own, e.g. Gemma's
            ``query_pre_attn_scalar ** -0.5``).
        window: sliding-window attention (needs positions): a query sees keys less than
            ``window`` positions behind it, as transformers' ``sliding_window`` does.
        return_scores: also return per-q-head probabilities summed over query tokens.
        softcap: the model's attention soft-capping (Gemma 2): each scaled logit ``s`` becomes
            ``softcap * tanh(s / softcap)`` before the bias and the softmax (:func:`cap_logits`).

    Computed in float32 whatever the input dtype, so it can serve as the oracle for fp16/bf16 paths.
    Long prompts are processed in query chunks (same result) so the logits never need more than
    about :data:`ATTEND_CHUNK_ELEMENTS` floats, whatever the prompt length.
    A query that can see no key (only possible with an empty cache) gets a zero output.
    """
    g = check_query(queries, keys)
    b, hq, t, d = queries.shape
    n = keys.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if window is not None and (q_positions is None or k_positions is None):
        raise ShapeError("window needs q_positions and k_positions")
    rows = max(1, ATTEND_CHUNK_ELEMENTS // max(1, b * hq * n))
    if t > rows:
        outs, total = [], None
        for s in range(0, t, rows):
            part = attend(
                queries[:, :, s : s + rows],
                keys,
                values,
                q_positions=None if q_positions is None else q_positions[s : s + rows],
                k_positions=k_positions,
                bias=bias,
                key_mask=key_mask,
                scale=scale,
                window=window,
                return_scores=return_scores,
                softcap=softcap,
            )
            outs.append(part.output)
            if part.scores is not None:
                total = part.scores if total is None else total + part.scores
        return AttentionOutput(torch.cat(outs, dim=2), total)
    hk = keys.shape[1]
    if not return_scores and softcap is None:
        return AttentionOutput(
            _attend_fused(queries, keys, values, q_positions, k_positions, bias, key_mask, scale, window)
        )
    # GQA without copying keys/values: each KV head's g query heads become g*t rows.
    q = (queries.float() * scale).reshape(b, hk, g * t, d)
    logits = cap_logits(torch.matmul(q, keys.float().transpose(-1, -2)).view(b, hk, g, t, n), softcap)
    if bias is not None:
        logits += bias.float()[:, :, None, None, :]
    allowed = _visibility(q_positions, k_positions, key_mask, window, n)  # smallest broadcast shape
    if allowed is not None:
        allowed = allowed[:, :, None]  # broadcast over the g query heads of a KV head
        logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if allowed is not None and not bool(allowed.any(dim=-1).all()):
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key
    out = torch.matmul(probs.view(b, hk, g * t, n), values.float()).view(b, hq, t, d).to(queries.dtype)
    return AttentionOutput(out, probs.sum(dim=3).reshape(b, hq, n) if return_scores else None)


def cap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention soft-capping of scaled logits, ``softcap * tanh(logits / softcap)``, as
    transformers' eager attention applies it (``None``: the logits as they are)."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def _visibility(
    q_positions: torch.Tensor | None,
    k_positions: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    window: int | None,
    n: int,
) -> torch.Tensor | None:
    """``[b|1, hk|1, t, n]`` bool, True where a query may see a key (``None``: everything visible)."""
    allowed: torch.Tensor | None = None
    if q_positions is not None and k_positions is not None:
        kp = k_positions.view(1, 1, 1, n) if k_positions.dim() == 1 else k_positions[:, :, None, :]
        qp = q_positions.view(1, 1, -1, 1)
        allowed = kp <= qp
        if window is not None:
            allowed = allowed & (kp > qp - window)
    if key_mask is not None:
        km = key_mask[:, :, None, :]
        allowed = km if allowed is None else allowed & km
    return allowed


def _attend_fused(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor | None,
    k_positions: torch.Tensor | None,
    bias: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The same attention through torch's fused SDPA (float32), for callers that need no scores.

    Same mathematics as the explicit path (mask and bias folded into one additive mask), without
    materialising the probabilities: prefill of methods that do not score tokens is then as fast
    as transformers' own attention.
    """
    b, hq, t, _ = queries.shape
    hk, n = keys.shape[1], keys.shape[2]
    g = hq // hk
    allowed = _visibility(q_positions, k_positions, key_mask, window, n)
    mask: torch.Tensor | None = None
    if bias is not None:
        mask = bias.float()[:, :, None, :].expand(b, hk, t, n)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, float("-inf"))
    elif allowed is not None:
        mask = allowed
    if mask is not None and mask.shape[1] != 1:
        mask = mask.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(
        queries.float(), keys.float(), values.float(), attn_mask=mask, scale=scale, enable_gqa=g > 1
    )
    if allowed is not None and not bool(allowed.any(dim=-1).all()):
        out = torch.nan_to_num(out, nan=0.0)  # rows with no visible key
    return out.to(queries.dtype)
