"""The importance family's algorithms, as pure functions: SnapKV's window scores and pooling, the
kept indices (sinks, top scores, recent window; ragged per head), PyramidKV's per-layer budgets
and adaptive (AdaKV-style) head budgets. :mod:`ov_kvcrush.methods.importance` builds the methods
on them; the op's ``selection.cpp`` reproduces the top-k order (ties to the lower index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import attend, check_query, check_scores
from ov_kvcrush.methods.base import topk_indices
from ov_kvcrush.validation import check_choice, check_float, check_int

SCORINGS = ("h2o", "snapkv")


HEAD_BUDGETS = ("uniform", "adaptive")


POOLS = ("max", "avg")


def snapkv_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    window: int,
    pool_kernel: int = 7,
    pool: str = "max",
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """SnapKV's per-q-head scores ``[b, hq, n]`` of the ``n`` prompt tokens.

    The last ``window`` queries attend causally to all keys; their probabilities are summed over
    the window and pooled along tokens (odd ``pool_kernel``, same length; 1 disables pooling).
    """
    check_query(queries, keys)
    check_int("window", window, 1, 1 << 20)
    check_int("pool_kernel", pool_kernel, 1, 129)
    if pool_kernel % 2 == 0:
        raise ConfigError("pool_kernel", pool_kernel, "an odd integer in [1, 129]")
    check_choice("pool", pool, POOLS)
    n, t = keys.shape[2], queries.shape[2]
    w = min(window, t)
    q_pos = torch.arange(n - w, n, device=keys.device)
    k_pos = torch.arange(n, device=keys.device)
    scores = attend(
        queries[:, :, t - w :],
        keys,
        keys,
        q_positions=q_pos,
        k_positions=k_pos,
        scale=scale,
        softcap=softcap,
        return_scores=True,
    ).scores
    return pool_scores(scores, pool_kernel, pool)


def pool_scores(scores: torch.Tensor, kernel: int, pool: str = "max") -> torch.Tensor:
    """1-D pooling of ``[b, h, n]`` scores along tokens, same length (SnapKV's clustering of neighbours)."""
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    b, h, n = scores.shape
    x = scores.reshape(b * h, 1, n)
    if pool == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return y.reshape(b, h, n)


def keep_indices(scores: torch.Tensor, budget: int, sink_tokens: int, recent_tokens: int) -> torch.Tensor:
    """Per-head indices (ascending) of the tokens to keep: sinks, recent, and the top scores between.

    Args:
        scores: ``[b, h, n]`` importance (higher is kept first; ties go to the earlier token).
        budget: tokens to keep per head; ``>= n`` keeps everything.
        sink_tokens, recent_tokens: always kept; their sum must not exceed ``budget``.

    Returns ``[b, h, min(budget, n)]`` long indices.
    """
    check_scores(scores)
    check_int("budget", budget, 0, 1 << 30)
    check_int("sink_tokens", sink_tokens, 0, 1 << 30)
    check_int("recent_tokens", recent_tokens, 0, 1 << 30)
    b, h, n = scores.shape
    dev = scores.device
    if budget >= n:
        return torch.arange(n, device=dev).expand(b, h, n).clone()
    if sink_tokens + recent_tokens > budget:
        raise ConfigError("budget", budget, f"at least sink_tokens + recent_tokens = {sink_tokens + recent_tokens}")
    heavy = budget - sink_tokens - recent_tokens
    middle = scores[..., sink_tokens : n - recent_tokens]
    top = topk_indices(middle, heavy) + sink_tokens
    sinks = torch.arange(sink_tokens, device=dev).expand(b, h, sink_tokens)
    recent = torch.arange(n - recent_tokens, n, device=dev).expand(b, h, recent_tokens)
    return torch.cat([sinks, top, recent], dim=-1)


@dataclass(frozen=True)
class SpanPlan:
    """A selection over spans of ``block`` tokens (paged attention's blocks), shared by every
    span-granular method (:func:`keep_block_indices`, block-wise KVCrush).

    ``scores`` ``[..., full]`` sums each full span's token scores; the trailing ``partial`` tokens
    are always kept; sinks and the recent window round up to whole spans (``sink``, ``recent``),
    and ``budget`` is the spans the token budget leaves beside the partial tail.
    """

    scores: torch.Tensor
    block: int
    n: int
    full: int
    partial: int
    sink: int
    recent: int
    budget: int

    def tokens(self, spans: torch.Tensor) -> torch.Tensor:
        """Token indices (ascending) of kept ``spans`` ``[..., k]`` (ascending), then the partial tail."""
        dev = spans.device
        tokens = (spans.unsqueeze(-1) * self.block + torch.arange(self.block, device=dev)).flatten(-2)
        tail = torch.arange(self.full * self.block, self.n, device=dev).expand(*spans.shape[:-1], self.partial)
        return torch.cat([tokens, tail], dim=-1)


def _sink_and_recent_spans(block: int, sink_tokens: int, recent_tokens: int, partial: int) -> tuple[int, int]:
    """Whole spans the sinks and the recent window round up to, beside a partial tail of
    ``partial`` tokens (which counts toward the recent window)."""
    return -(-sink_tokens // block), -(-max(recent_tokens - partial, 0) // block)


def plan_spans(
    scores: torch.Tensor,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    block: int,
    reserved: int = 0,
    what: str = "",
) -> SpanPlan:
    """The :class:`SpanPlan` of ``[..., n]`` scores (``budget < n``). ``reserved`` spans must fit
    beside the sink and recent ones (KVCrush's representatives); ``what`` names them all in the
    error that says the budget has no room."""
    n = scores.shape[-1]
    full = n // block
    partial = n - full * block
    sink_b, recent_b = _sink_and_recent_spans(block, sink_tokens, recent_tokens, partial)
    budget_b = (budget - partial) // block
    if sink_b + recent_b + reserved > budget_b:
        need = (sink_b + recent_b + reserved) * block + partial
        raise ConfigError("budget", budget, f"room for {what} of {block} tokens ({need} tokens here)")
    span_scores = scores[..., : full * block].reshape(*scores.shape[:-1], full, block).sum(-1)
    return SpanPlan(span_scores, block, n, full, partial, sink_b, recent_b, budget_b)


def span_budget_floor(block: int, sink_tokens: int, recent_tokens: int, reserved: int = 0) -> int:
    """The smallest budget :func:`plan_spans` accepts at **every** length of the scored sequence.

    Its floor depends on the trailing partial span (``n mod block`` tokens, always kept), which
    changes with every decoded token; a budget checked only against the prompt's length could
    pass at prefill and be refused a few tokens later. Configs check this worst case, so a run
    either starts with room for its spans or is refused before it starts (the op computes the
    same floor: ``plugins/cpu/src/selection.cpp``, ``plan_spans``).
    """
    return max(
        (sum(_sink_and_recent_spans(block, sink_tokens, recent_tokens, p)) + reserved) * block + p for p in range(block)
    )


def keep_block_indices(
    scores: torch.Tensor, budget: int, sink_tokens: int, recent_tokens: int, block: int
) -> torch.Tensor:
    """:func:`keep_indices` over spans of ``block`` tokens: each head keeps whole spans.

    Scores are summed per full span; the trailing partial span (``n mod block`` tokens) is always
    kept, the sink and recent windows round up to whole spans, and the top-scoring spans fill the
    rest of ``budget`` (:func:`plan_spans`). Returns ``[b, h, k]`` ascending indices, ``k <= budget``.
    """
    check_scores(scores)
    check_int("block_size", block, 1, 1 << 16)
    b, h, n = scores.shape
    if budget >= n:
        return torch.arange(n, device=scores.device).expand(b, h, n).clone()
    plan = plan_spans(scores.float(), budget, sink_tokens, recent_tokens, block, what="the sink and recent spans")
    return plan.tokens(keep_indices(plan.scores, plan.budget, plan.sink, plan.recent))


def keep_chunk_indices(
    scores: torch.Tensor, positions: torch.Tensor, drop: int, sink_tokens: int, last_old: int
) -> torch.Tensor:
    """Chunks to keep ``[b, h, chunks - d]`` (ascending) of ``scores`` ``[b, h, chunks]``.

    Each head drops its ``d`` lowest-scoring chunks (ties: the older first), ``d`` being ``drop``
    or fewer when some head has fewer chunks that may go: none holding a sink (position below
    ``sink_tokens``) or a position after ``last_old`` (the recent window). ``positions``
    ``[b, h, chunks * r]``: the chunks' tokens. Every head drops the same number, so the
    result is one width (the quantized store's chunk eviction)."""
    b, h, chunks = scores.shape
    if chunks == 0:
        return torch.zeros(b, h, 0, dtype=torch.long, device=scores.device)
    pos = positions.reshape(b, h, chunks, -1)
    stays = (pos < sink_tokens).any(-1) | (pos > last_old).any(-1)
    drop = max(0, min(drop, int((~stays).sum(-1).min())))
    order = torch.sort(scores.masked_fill(stays, float("inf")), dim=-1, stable=True).indices
    return torch.sort(order[..., drop:], dim=-1).values


def keep_indices_ragged(
    scores: torch.Tensor, lengths: torch.Tensor, budgets: torch.Tensor, sink_tokens: int, recent_tokens: int
) -> torch.Tensor:
    """:func:`keep_indices` when heads hold and keep different numbers of tokens.

    Head ``(b, h)`` holds its first ``lengths[b, h]`` slots (the rest is padding) and keeps
    ``min(budgets[b, h], lengths[b, h])`` of them: its sinks, its last ``recent_tokens`` held
    slots, and the top scores between. Returns ``[b, h, w]`` ascending indices padded with ``-1``.
    """
    check_scores(scores)
    n = scores.shape[-1]
    slot = torch.arange(n, device=scores.device)
    length = lengths.unsqueeze(-1)
    valid = slot < length
    protected = valid & ((slot < sink_tokens) | (slot >= length - recent_tokens))
    eff = scores.float().masked_fill(~valid, float("-inf")).masked_fill(protected, float("inf"))
    keep_n = torch.minimum(budgets, lengths)
    width = int(keep_n.max()) if keep_n.numel() else 0
    order = torch.argsort(eff, dim=-1, descending=True, stable=True)[..., :width]
    ok = torch.arange(width, device=scores.device) < keep_n.unsqueeze(-1)
    order = torch.sort(torch.where(ok, order, torch.full_like(order, n)), dim=-1).values
    return torch.where(order == n, torch.full_like(order, -1), order)


def pyramid_budgets(average: int, num_layers: int, depth: float) -> list[int]:
    """Per-layer budgets, linear from ``(2 - 1/depth) * average`` (layer 0) to ``average / depth`` (last).

    Their sum is exactly ``average * num_layers`` (largest-remainder rounding), so a pyramid spends
    the same memory as a uniform allocation. ``depth = 1`` is uniform. Lower layers get more: their
    attention is spread wider, so the same budget loses more there (PyramidKV; MiniKV's pyramid).
    """
    check_int("average", average, 0, 1 << 30)
    check_int("num_layers", num_layers, 1, 4096)
    check_float("pyramid_depth", depth, 1.0, 1e6)
    if num_layers == 1:
        return [average]
    top, bottom = average * (2 - 1 / depth), average / depth
    exact = [top + (bottom - top) * i / (num_layers - 1) for i in range(num_layers)]
    base = [int(x) for x in exact]
    short = average * num_layers - sum(base)
    by_remainder = sorted(range(num_layers), key=lambda i: (-(exact[i] - base[i]), i))
    for i in by_remainder[:short]:
        base[i] += 1
    return base


def adaptive_head_budgets(scores: torch.Tensor, total: int, min_per_head: int = 0) -> torch.Tensor:
    """How many tokens each head keeps when a layer's heads share ``total`` (AdaKV-style).

    Each head's scores are normalised to sum to 1, so heads with concentrated attention need few
    tokens to cover most of their mass and leave the rest to flatter heads; the ``total`` largest
    normalised scores over all heads are kept, every head at least ``min_per_head``.

    Returns ``[b, h]`` counts summing to ``min(total, h * n)``.
    """
    check_scores(scores)
    b, h, n = scores.shape
    check_int("total", total, 0, 1 << 30)
    check_int("min_per_head", min_per_head, 0, 1 << 30)
    total = min(total, h * n)
    floor = min(min_per_head, n)
    if floor * h > total:
        raise ConfigError("min_per_head", min_per_head, f"at most total/heads = {total // h}")
    norm = scores.float() / scores.float().sum(dim=-1, keepdim=True).clamp_min(1e-30)
    if floor:
        forced = topk_indices(norm, floor)
        norm = norm.scatter(-1, forced, float("inf"))
    flat = norm.reshape(b, h * n)
    chosen = topk_indices(flat, total)
    counts = torch.zeros(b, h * n, dtype=torch.long, device=scores.device).scatter_(1, chosen, 1)
    return counts.reshape(b, h, n).sum(dim=-1)
