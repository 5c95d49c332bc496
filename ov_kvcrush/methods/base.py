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
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.validation import check_int


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

#: Largest ``[batch, q_heads, q_chunk, keys]`` logits block :func:`attend` materialises at once
#: (64 Mi floats = 256 MiB in float32); longer prompts are split into query chunks.
ATTEND_CHUNK_ELEMENTS = 1 << 26


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
            )
            outs.append(part.output)
            if part.scores is not None:
                total = part.scores if total is None else total + part.scores
        return AttentionOutput(torch.cat(outs, dim=2), total)
    hk = keys.shape[1]
    if not return_scores:
        return AttentionOutput(
            _attend_fused(queries, keys, values, q_positions, k_positions, bias, key_mask, scale, window)
        )
    # GQA without copying keys/values: each KV head's g query heads become g*t rows.
    q = (queries.float() * scale).reshape(b, hk, g * t, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).view(b, hk, g, t, n)
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


def storage_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj`` (an independent measurement).

    Walks attributes, lists, tuples, dicts and sets, and counts each underlying storage once at
    its allocated size, so a "kept" slice that still pins a full-size tensor is counted in full.
    This is how tests check that what a cache reports is what it really holds.
    """
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
            return
        if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device)) or id(x) in seen_objects:
            return
        seen_objects.add(id(x))
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dict__"):
            for k, v in vars(x).items():
                if k != "config":  # frozen configs hold no tensors but may be shared
                    walk(v)

    walk(obj)
    return sum(storages.values())


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
        check_int("quant.residual_tokens", self.residual_tokens, self.group_size, 1 << 16)
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
    check_int("num_layers", num_layers, 1, 4096)
    check_int("layer_idx", layer_idx, 0, num_layers - 1)


# --------------------------------------------------------------------------------------------
# per-layer cache protocol


@dataclass
class PromptMemo:
    """The prompt's attention, computed once and offered to other methods' prefill of the same prompt.

    Every method's prefill attends the prompt exactly (causal, no bias), so when several methods
    take the same prompt (an evaluation comparing them) the output, and the per-head scores once
    one method has asked for them, need computing only once. :meth:`LayerCache._attend` uses the
    memo only for a call on the very tensors it was built from (same objects), without bias, key
    mask or window, so no other attention can be served from it.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    output: torch.Tensor
    with_scores: AttentionOutput | None = None


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
        #: logit scale of the model's attention (``None``: ``1/sqrt(head_dim)``); engines set it
        #: from the attention module, since some families (Gemma) scale differently.
        self.scale: float | None = None
        #: wall time (ms) spent in :meth:`_attend` on CPU tensors: the engine subtracts it from a
        #: step's time to report the method's own work (selection, clustering, merging ...).
        self.attend_ms = 0.0

    #: set by an engine around a prefill whose prompt attention is already known (:class:`PromptMemo`).
    prompt_memo: PromptMemo | None = None

    def _attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kw: Any) -> AttentionOutput:
        """:func:`attend` with this layer's logit scale (served from :attr:`prompt_memo` when it
        applies), timed into :attr:`attend_ms` on the CPU (CUDA calls return before the work ends)."""
        if queries.device.type != "cpu":
            return self._attend_untimed(queries, keys, values, **kw)
        t0 = time.perf_counter()
        try:
            return self._attend_untimed(queries, keys, values, **kw)
        finally:
            self.attend_ms += (time.perf_counter() - t0) * 1e3

    def _attend_untimed(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kw: Any
    ) -> AttentionOutput:
        memo = self.prompt_memo
        if (
            memo is not None
            and queries is memo.queries
            and keys is memo.keys
            and values is memo.values
            and kw.get("bias") is None
            and kw.get("key_mask") is None
            and kw.get("window") is None
        ):
            if not kw.get("return_scores"):
                return AttentionOutput(memo.output)
            if memo.with_scores is None:
                memo.with_scores = attend(queries, keys, values, scale=self.scale, **kw)
            scores = memo.with_scores.scores
            # each method gets its own scores: accumulators are updated in place while decoding
            return AttentionOutput(memo.with_scores.output, None if scores is None else scores.clone())
        return attend(queries, keys, values, scale=self.scale, **kw)

    @abstractmethod
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of the prompt over itself (causal), then the method's compression."""

    def decode(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Append the step's keys/values, attend the step's queries over what is held.

        Validates the step; on a cache that has seen nothing yet, the step is the prompt
        (:meth:`prefill`). Methods implement :meth:`_decode_step`.
        """
        check_kv(keys, values)
        check_query(queries, keys)
        if not self.seen:
            return self.prefill(queries, keys, values)
        return self._decode_step(queries, keys, values)

    @abstractmethod
    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One validated decode step on a cache that already holds the prompt."""

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
