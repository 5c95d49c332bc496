"""What every method shares: the config base class, the per-layer cache protocol and the reference attention.

Tensors follow one layout everywhere (the layout transformers uses inside attention):

* keys / values ``[batch, kv_heads, tokens, head_dim]`` (keys after RoPE, so a kept key needs no
  position to be re-applied),
* queries ``[batch, q_heads, q_tokens, head_dim]`` with ``q_heads`` a multiple of ``kv_heads``
  (grouped-query attention: query head ``j`` reads KV head ``j // (q_heads // kv_heads)``),
* per-head statistics ``[batch, heads, tokens]``.

Nothing here is CPU-specific: every tensor is created on the device of the inputs, so the same
code is the oracle on CPU and the CUDA path on a GPU.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from ov_kvcrush.config import MAX_TOKENS, _check_int
from ov_kvcrush.errors import ConfigError, UserError


class ShapeError(UserError):
    """A tensor handed to a method has the wrong rank, size or dtype; the message names it."""


# --------------------------------------------------------------------------------------------
# input checks


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


# --------------------------------------------------------------------------------------------
# reference attention


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
    return_scores: bool = False,
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
        scale: logit scale; ``1/sqrt(head_dim)`` by default.
        return_scores: also return per-q-head probabilities summed over query tokens.

    Computed in float32 whatever the input dtype, so it can serve as the oracle for fp16/bf16 paths.
    A query that can see no key (only possible with an empty cache) gets a zero output.
    """
    g = check_query(queries, keys)
    b, hq, t, d = queries.shape
    n = keys.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    q = queries.float()
    k = keys.float().repeat_interleave(g, dim=1)
    v = values.float().repeat_interleave(g, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, hq, t, n]
    if bias is not None:
        logits = logits + bias.float().repeat_interleave(g, dim=1)[:, :, None, :]
    allowed = torch.ones((b, hq, t, n), dtype=torch.bool, device=queries.device)
    if key_mask is not None:
        allowed &= key_mask.repeat_interleave(g, dim=1)[:, :, None, :]
    if q_positions is not None and k_positions is not None:
        kp = k_positions if k_positions.dim() == 3 else k_positions.expand(b, keys.shape[1], n)
        kp = kp.repeat_interleave(g, dim=1)[:, :, None, :]
        allowed &= kp <= q_positions.view(1, 1, t, 1)
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key
    out = torch.matmul(probs, v).to(queries.dtype)
    return AttentionOutput(out, probs.sum(dim=2) if return_scores else None)


# --------------------------------------------------------------------------------------------
# selection helpers shared by the eviction methods


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last dim, ties broken by the lower index, ascending.

    Deterministic on every device (``torch.topk`` leaves tie order unspecified), which the fast
    paths need to reproduce the same token choice.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ShapeError(f"k={k} must be in [0, {n}]")
    if k == 0:
        return torch.empty((*scores.shape[:-1], 0), dtype=torch.long, device=scores.device)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    return torch.sort(order[..., :k], dim=-1).values


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather tokens along dim 2 of ``x`` (``[b, h, n, ...]``) with per-head ``index`` ``[b, h, k]``."""
    idx = index
    while idx.dim() < x.dim():
        idx = idx.unsqueeze(-1)
    return torch.gather(x, 2, idx.expand(*index.shape, *x.shape[3:]))


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (their storage as allocated, not an estimate)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# --------------------------------------------------------------------------------------------
# config base


@dataclass(frozen=True)
class QuantSettings:
    """MiniKV's 2-bit KV store, usable under any selection method.

    Attributes:
        bits: bits per stored value; only 2 is implemented (16 values per int32).
        group_size: values sharing one fp16 scale and zero: keys are grouped per channel along
            tokens, values per token along channels. 16 by default (MiniKV, KIVI).
        residual_tokens: the newest tokens kept in full precision; when that many have
            accumulated they are quantized together (flushed every ``residual_tokens`` steps).
            A multiple of ``group_size``.
    """

    bits: int = 2
    group_size: int = 16
    residual_tokens: int = 128

    def __post_init__(self) -> None:
        if self.bits != 2 or isinstance(self.bits, bool):
            raise ConfigError("quant.bits", self.bits, "2 (the only packed width implemented)")
        if self.group_size not in (16, 32, 64, 128):
            raise ConfigError("quant.group_size", self.group_size, "one of 16, 32, 64, 128")
        _check_int("quant.residual_tokens", self.residual_tokens, self.group_size, 1 << 16)
        if self.residual_tokens % self.group_size:
            raise ConfigError(
                "quant.residual_tokens", self.residual_tokens, f"a multiple of quant.group_size={self.group_size}"
            )


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method's config: a name in the registry and a factory for per-layer caches.

    Subclasses are frozen dataclasses whose ``__post_init__`` validates every field and raises
    :class:`~ov_kvcrush.errors.ConfigError` naming it.
    """

    name: ClassVar[str] = ""
    #: whether the method keeps a bounded number of tokens (``budget`` is required).
    needs_budget: ClassVar[bool] = True

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        """A fresh cache for one layer (``layer_idx`` in ``[0, num_layers)``)."""
        raise NotImplementedError

    def layer_budget(self, layer_idx: int, num_layers: int) -> int | None:
        """Tokens this layer may hold per KV head (``None``: unbounded)."""
        return getattr(self, "budget", None)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields plus ``method``, for JSON reports."""
        return {"method": self.name, **asdict(self)}


def check_layer(layer_idx: int, num_layers: int) -> None:
    """Validate a layer index against the layer count."""
    _check_int("num_layers", num_layers, 1, 4096)
    _check_int("layer_idx", layer_idx, 0, num_layers - 1)


def check_budget(name: str, budget: Any, floor: int, what: str = "") -> None:
    """``budget`` must be an int in ``[floor, MAX_TOKENS]``; ``what`` explains the floor."""
    if isinstance(budget, bool) or not isinstance(budget, int) or not floor <= budget <= MAX_TOKENS:
        raise ConfigError(name, budget, f"an integer in [{floor}, {MAX_TOKENS}]{what}")


# --------------------------------------------------------------------------------------------
# per-layer cache protocol


class LayerCache(ABC):
    """The compressed KV state of one layer of one batch, plus the attention over it.

    The engine calls :meth:`prefill` once with the whole prompt, then :meth:`decode` for every
    new token (or a few tokens at once, e.g. a new chat turn). Both return the attention output
    for the given queries computed over what the method keeps; the prefill output is exact (all
    methods compress after the prompt has been seen, as in their papers).

    ``counters`` holds per-method statistics (evictions, merges, cluster-cache hits ...), all
    plain numbers so they can go into JSON.
    """

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.seen = 0  # tokens appended so far (the next token's position)

    @abstractmethod
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of the prompt over itself (causal), then the method's compression."""

    @abstractmethod
    def decode(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Append the step's keys/values, attend the step's queries over what is held."""

    @abstractmethod
    def tokens_held(self) -> torch.Tensor:
        """``[batch, kv_heads]`` tokens (or merged tokens) held per head."""

    @abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes held: ``kv`` (key/value payload incl. quantization scales), ``metadata``
        (scores, centroids, degrees, positions ...), ``total``."""

    def nbytes(self) -> int:
        """Total bytes held (``memory()['total']``)."""
        return self.memory()["total"]

    def _start_prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Validate a prompt (shapes, one query per token, first call) and return its positions."""
        check_kv(keys, values)
        check_query(queries, keys)
        if self.seen:
            raise RuntimeError("prefill called twice on the same layer cache; use decode for later tokens")
        if queries.shape[2] != keys.shape[2]:
            raise ShapeError(
                f"prefill needs one query per prompt token: {queries.shape[2]} queries, {keys.shape[2]} keys"
            )
        return self._positions(keys.shape[2], keys.device)

    def _positions(self, t: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(self.seen, self.seen + t, device=device)
        self.seen += t
        return pos

    def _bump(self, key: str, amount: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + amount
