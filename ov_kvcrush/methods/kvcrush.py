"""KVCrush (seed 004): binary head-behaviour signatures, Hamming bucketing, one representative per bucket.

For a layer with ``H`` query heads, every token gets an ``H``-bit signature: bit ``h`` is 1 when
head ``h`` would retain the token on its own (``signature="topk"``: the token is in that head's
top ``budget - sinks - recent`` by its own scores, i.e. the head's own H2O/SnapKV decision;
``"threshold"``: its score is at least the head's mean score). Signatures are packed 32 bits per
integer and compared with popcount Hamming distance.

The budget is split: ``budget - representatives`` tokens are the important ones (sinks, recent
window and the top scores summed over heads, as H2O/SnapKV would keep), and ``representatives``
slots go to the evictable tokens (everything else). Those are ordered by their distance to the
anchor (ties by position) and cut into ``representatives`` contiguous, near-equal ranges of that
ordering, the buckets; each bucket contributes one token (``representative="max_score"``: its
highest-scoring token; ``"first"``: the one nearest the anchor). Buckets are ranges of the
ordering, not distance values: with 9 heads there are only 10 possible distances, but every
region of the signature space still gets represented.

Anchors: ``random`` (seeded), ``zeros``, ``ones``, ``mean`` (per-bit majority of the evictable
tokens) and ``alternating`` (1010...). Several anchors (a tuple of modes) order tokens either by
their distance tuple (lexicographic) or by nearest anchor, then distance.

A signature spans the heads of the layer, so every KV head of the layer keeps the same tokens
(``scope="layer"``, the default, as OpenVINO GenAI's per-layer block tables do). ``scope="head"``
runs the same selection once per KV head on its own query group's scores, as SnapKV selects per
head: the important tokens are then exactly SnapKV's at ``budget - representatives``.
``block_size`` switches to the paged-attention variant: scores are summed per block of that many
tokens, whole blocks are kept or evicted, and the trailing partial block always stays.

Paper: Jha et al., "KVCrush: Key value cache size-reduction using similarity in head-behaviour",
arXiv 2503.00022 (and the OpenVINO article, seed 004).

Where this departs from it:

* Buckets are contiguous near-equal ranges of the distance ordering, not one bucket per distance
  value: with few heads (9 here) distances take only 10 values, which would leave most of the
  ``representatives`` budget unused.
* The representatives are part of ``budget`` (not on top of it), so methods compare at equal
  memory; native openvino_genai keeps its KVCrush blocks on top of ``max_cache_size``.
* Multi-anchor ordering (``tuple``/``nearest``) and the ``threshold`` signature are options the
  paper mentions without fixing; the defaults (one random anchor, top-k signatures) follow it.
* The decode-time budget is enforced every step (the paper compresses after the prompt); over the
  quantized store by dropping whole flushed chunks (ranked per layer with the per-layer scope).
* ``scope="head"`` (an option; the default is the paper's per-layer choice): a KV head's
  signature has only its group's bits, and its anchors are that group's bits of the layer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import ShapeError, check_scores
from ov_kvcrush.methods.base import topk_indices
from ov_kvcrush.methods.importance import ImportanceLayerCache, SnapKVConfig
from ov_kvcrush.methods.runtimes import ADAPTIVE_HEAD_BUDGETS, Declaration
from ov_kvcrush.methods.selection import keep_indices, plan_spans
from ov_kvcrush.validation import check_choice, check_int

ANCHOR_MODES = ("random", "zeros", "ones", "mean", "alternating")
MULTI_ANCHOR = ("tuple", "nearest")
SIGNATURES = ("topk", "threshold")
REPRESENTATIVES = ("max_score", "first")
SCOPES = ("layer", "head")
WORD_BITS = 32  # bits packed per int64 word (kept non-negative so shifts stay logical)


# --------------------------------------------------------------------------------------------
# signatures and Hamming distance


def head_decisions(scores: torch.Tensor, keep: int, mode: str = "topk") -> torch.Tensor:
    """Bool ``[b, h, n]``: would head ``h`` retain the token on its own?

    ``topk``: the token is among the head's ``keep`` highest scores (ties to the earlier token).
    ``threshold``: its score is at least the head's mean score over the ``n`` tokens.
    """
    check_scores(scores)
    check_choice("signature", mode, SIGNATURES)
    n = scores.shape[-1]
    if mode == "threshold":
        return scores >= scores.mean(dim=-1, keepdim=True)
    k = min(max(keep, 0), n)
    bits = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return bits.scatter(-1, topk_indices(scores, k), True)


def pack_signatures(bits: torch.Tensor) -> torch.Tensor:
    """Pack bool ``[..., H]`` into int64 ``[..., ceil(H / 32)]`` words.

    Head ``h`` is bit ``h % 32`` of word ``h // 32``; words stay below ``2**32`` so shifts are logical.
    """
    h = bits.shape[-1]
    words = max(1, -(-h // WORD_BITS))
    padded = torch.zeros((*bits.shape[:-1], words * WORD_BITS), dtype=torch.int64, device=bits.device)
    padded[..., :h] = bits.to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=bits.device) << torch.arange(
        WORD_BITS, device=bits.device, dtype=torch.int64
    )
    return (padded.reshape(*bits.shape[:-1], words, WORD_BITS) * weights).sum(dim=-1)


def popcount(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each non-negative int64 below ``2**32`` (SWAR, the same steps as a hardware popcount)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


def hamming(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamming distance between packed signatures (broadcasting over leading dims, summed over words)."""
    return popcount(torch.bitwise_xor(a, b)).sum(dim=-1)


def make_anchors(
    bits: torch.Tensor, modes: tuple[str, ...], seed: int, draw: tuple[int, int] | None = None
) -> torch.Tensor:
    """Anchor signatures ``[b, A, H]`` (bool) for evictable-token signatures ``bits`` ``[b, m, H]``.

    ``random`` anchors come from a CPU generator seeded with ``seed + i`` (``i`` the anchor's
    index), so they are the same on every device and run. ``draw`` ``(heads, offset)``: a fixed
    anchor is drawn over ``heads`` bits (the layer's query heads) and bits ``offset : offset + H``
    are used, so each KV head of ``scope="head"`` reads its own query group's part of the layer's
    anchor (a ``mean`` anchor is always its own tokens' majority).
    """
    b, m, h = bits.shape
    width, offset = draw if draw is not None else (h, 0)
    if not 0 <= offset <= width - h:
        raise ShapeError(f"anchor bits {offset}..{offset + h} outside the {width} drawn")
    out = []
    for i, mode in enumerate(modes):
        check_choice("anchor", mode, ANCHOR_MODES)
        if mode == "mean":
            out.append(
                ((bits.float().mean(dim=1) >= 0.5).cpu() if m else torch.zeros(b, h, dtype=torch.bool)).to(bits.device)
            )
            continue
        if mode == "zeros":
            a = torch.zeros(b, width, dtype=torch.bool)
        elif mode == "ones":
            a = torch.ones(b, width, dtype=torch.bool)
        elif mode == "alternating":
            a = (torch.arange(width) % 2 == 0).expand(b, width)
        else:
            gen = torch.Generator().manual_seed(seed + i)
            a = torch.rand(b, width, generator=gen) < 0.5
        out.append(a[:, offset : offset + h].to(bits.device))
    return torch.stack(out, dim=1)


def bucket_order(distances: torch.Tensor, multi: str = "tuple") -> torch.Tensor:
    """Order of tokens for bucketing: ``[b, m]`` indices into the ``m`` tokens.

    ``distances`` is ``[b, m, A]`` (tokens given in position order). One anchor: by distance, ties
    by position. Several: ``tuple`` sorts by the distance tuple lexicographically; ``nearest`` by
    (index of the nearest anchor, its distance); ties by position in both.
    """
    check_choice("multi_anchor", multi, MULTI_ANCHOR)
    b, m, a = distances.shape
    if multi == "nearest" and a > 1:
        d, which = distances.min(dim=-1)  # min returns the first (lowest) anchor on ties
        keys = [which, d]
    else:
        keys = [distances[..., i] for i in range(a)]
    order = torch.arange(m, device=distances.device).expand(b, m)
    for key in reversed(keys):  # stable sorts from the least significant key: lexicographic order
        order = torch.gather(order, 1, torch.argsort(torch.gather(key, 1, order), dim=1, stable=True))
    return order


def bucket_bounds(m: int, buckets: int) -> list[tuple[int, int]]:
    """Split ``m`` ordered items into ``buckets`` contiguous near-equal ranges ``[start, end)`` (none empty)."""
    buckets = min(buckets, m)
    return [(j * m // buckets, (j + 1) * m // buckets) for j in range(buckets)]


@dataclass
class KVCrushSelection:
    """What :func:`kvcrush_select` decided, for one batch row (tests and diagnostics read it).

    Attributes:
        keep: ascending token indices kept (``important`` and ``representatives`` together).
        important: the important tokens (sinks, recent, top summed scores).
        representatives: one token per bucket, in bucket order.
        evictable: the other tokens, in position order.
        order: positions into ``evictable`` in bucketing order.
        bounds: bucket ranges over ``order``.
        distances: ``[len(evictable), A]`` Hamming distance of each evictable token to each anchor.
        bits: ``[n, H]`` every token's signature, unpacked (sinks and recent tokens are all 0).
        anchors: ``[A, H]`` the anchors' signatures, unpacked.
    """

    keep: torch.Tensor
    important: torch.Tensor
    representatives: torch.Tensor
    evictable: torch.Tensor
    order: torch.Tensor
    bounds: list[tuple[int, int]]
    distances: torch.Tensor
    bits: torch.Tensor
    anchors: torch.Tensor


def kvcrush_select(
    scores: torch.Tensor,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    representatives: int,
    *,
    signature: str = "topk",
    anchors: tuple[str, ...] = ("random",),
    multi_anchor: str = "tuple",
    seed: int = 0,
    representative: str = "max_score",
    anchor_draw: tuple[int, int] | None = None,
) -> list[KVCrushSelection]:
    """KVCrush's token choice for each batch row from per-query-head scores ``[b, H, n]``.

    ``budget`` tokens are kept in all (``min(budget, n)``): ``budget - representatives`` important
    tokens and up to ``representatives`` bucket representatives. ``anchor_draw``: see
    :func:`make_anchors` (``H`` is then one KV head's query group).
    """
    check_scores(scores)
    check_int("budget", budget, 0, 1 << 30)
    check_int("representatives", representatives, 0, 1 << 30)
    check_choice("representative", representative, REPRESENTATIVES)
    if not anchors:
        raise ConfigError("anchor", anchors, "one or more of " + ", ".join(ANCHOR_MODES))
    b, h, n = scores.shape
    dev = scores.device
    if budget >= n:
        every = torch.arange(n, device=dev)
        empty = torch.empty(0, dtype=torch.long, device=dev)
        zero_d = torch.empty(0, len(anchors), dtype=torch.long, device=dev)
        no_bits = torch.zeros(n, h, dtype=torch.bool, device=dev)
        no_anchor = torch.zeros(len(anchors), h, dtype=torch.bool, device=dev)
        return [KVCrushSelection(every, every, empty, empty, empty, [], zero_d, no_bits, no_anchor) for _ in range(b)]
    if representatives > budget - sink_tokens - recent_tokens:
        raise ConfigError(
            "representatives",
            representatives,
            f"at most budget - sink_tokens - recent_tokens = {budget - sink_tokens - recent_tokens}",
        )
    combined = scores.float().sum(dim=1, keepdim=True)  # [b, 1, n]
    important = keep_indices(combined, budget - representatives, sink_tokens, recent_tokens)[:, 0]
    per_head_keep = budget - sink_tokens - recent_tokens
    middle = slice(sink_tokens, n - recent_tokens)
    bits_all = torch.zeros(b, h, n, dtype=torch.bool, device=dev)
    bits_all[..., middle] = head_decisions(scores[..., middle].float(), per_head_keep, signature)
    out = []
    for row in range(b):
        mask = torch.ones(n, dtype=torch.bool, device=dev)
        mask[important[row]] = False
        evictable = torch.nonzero(mask).flatten()
        bits = bits_all[row, :, evictable].T.unsqueeze(0)  # [1, m, H]
        anchor_bits = make_anchors(bits, anchors, seed, anchor_draw)  # [1, A, H]
        sig = pack_signatures(bits)[0]  # [m, W]
        anc = pack_signatures(anchor_bits)[0]  # [A, W]
        dist = hamming(sig.unsqueeze(1), anc.unsqueeze(0))  # [m, A]
        order = bucket_order(dist.unsqueeze(0), multi_anchor)[0]
        bounds = bucket_bounds(evictable.numel(), representatives)
        rep_t = _representatives(evictable[order], combined[row, 0], bounds, representative)
        keep = torch.sort(torch.cat([important[row], rep_t])).values
        steps = (evictable, order, bounds, dist, bits_all[row].T, anchor_bits[0])
        out.append(KVCrushSelection(keep, important[row], rep_t, *steps))
    return out


def _representatives(
    members: torch.Tensor, score: torch.Tensor, bounds: list[tuple[int, int]], representative: str
) -> torch.Tensor:
    """One token per bucket (contiguous ``bounds`` over ``members``, the bucket ordering).

    ``first``: the bucket's first token; ``max_score``: its highest-scoring token, the first one
    on ties. Vectorised over buckets (a segment max), as this runs at every eviction.
    """
    dev = members.device
    if not bounds:
        return torch.empty(0, dtype=torch.long, device=dev)
    starts = torch.tensor([b for b, _ in bounds], device=dev)
    if representative == "first":
        return members[starts]
    sizes = torch.tensor([e - b for b, e in bounds], device=dev)
    bucket = torch.repeat_interleave(torch.arange(len(bounds), device=dev), sizes)
    vals = score[members].float()
    best = torch.full((len(bounds),), float("-inf"), device=dev).scatter_reduce(0, bucket, vals, "amax")
    where = torch.arange(members.numel(), device=dev)
    first = torch.where(vals == best[bucket], where, torch.full_like(where, members.numel()))
    pos = torch.full((len(bounds),), members.numel(), device=dev).scatter_reduce(0, bucket, first, "amin")
    return members[pos]


def kvcrush_select_blocks(
    scores: torch.Tensor,
    block_size: int,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    representatives: int,
    **kwargs: object,
) -> list[torch.Tensor]:
    """Block-wise KVCrush: whole blocks of ``block_size`` tokens kept or evicted, as in paged attention.

    Per-head block scores are the sums over the block's tokens; block signatures, importance and
    buckets are computed on blocks exactly as :func:`kvcrush_select` does on tokens. Sinks and
    recent tokens are rounded up to whole blocks; the trailing partial block (the one being
    filled) is always kept. Budgets in tokens are rounded down to whole blocks. Returns the kept
    token indices (ascending) per batch row.
    """
    check_scores(scores)
    check_int("block_size", block_size, 1, 1 << 16)
    b, n = scores.shape[0], scores.shape[-1]
    if budget >= n:
        return [torch.arange(n, device=scores.device) for _ in range(b)]
    reps_b = representatives // block_size
    what = "sink, recent and representative blocks"
    plan = plan_spans(scores, budget, sink_tokens, recent_tokens, block_size, reserved=reps_b, what=what)
    sel = kvcrush_select(plan.scores, plan.budget, plan.sink, plan.recent, reps_b, **kwargs)  # type: ignore[arg-type]
    return [plan.tokens(s.keep) for s in sel]


# --------------------------------------------------------------------------------------------
# config and layer cache


@dataclass(frozen=True)
class KVCrushConfig(SnapKVConfig):
    """KVCrush over H2O/SnapKV importance, per-head signatures (the faithful version).

    Attributes:
        representatives: budget slots for bucket representatives (part of ``budget``, not on top).
            ``None``: a quarter of ``budget - sink_tokens - recent_tokens``.
        selection: importance scores: ``snapkv`` (window + pooling) or ``h2o`` (accumulated).
        signature: ``topk`` (each head's own keep decision) or ``threshold`` (score >= head mean).
        anchor: one mode or a tuple of modes (multi-anchor) among ``random``, ``zeros``, ``ones``,
            ``mean``, ``alternating``.
        multi_anchor: with several anchors, order by distance ``tuple`` or ``nearest`` anchor.
        seed: seed of random anchors.
        representative: ``max_score`` (the bucket's highest-scoring token) or ``first`` (the
            bucket's token nearest the anchor).
        block_size: ``None`` for token granularity, else paged-attention blocks of that size.
        scope: ``layer``: one selection per layer, signatures over all its query heads, every KV
            head keeps the same tokens (as OpenVINO GenAI, whose block tables are per layer);
            ``head``: each KV head selects for itself, as SnapKV does: its important tokens by its
            own query group's scores, signatures of that group's heads, its own representatives.
    """

    name: ClassVar[str] = "kvcrush"
    departure: ClassVar[str] = "the paper's; representatives count within the budget"
    #: over the quantized store decode steps drop whole flushed chunks, ranked per layer with
    #: ``scope="layer"`` (every head keeps the same tokens), per KV head with ``"head"``
    evicts_quantized_chunks: ClassVar[bool] = True
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cpu-op": (ADAPTIVE_HEAD_BUDGETS,),
        "gpu-plugin": (),
        "gpu-pool": (),
        "genai": (),
    }
    representatives: int | None = None
    selection: str = "snapkv"
    signature: str = "topk"
    anchor: str | tuple[str, ...] = "random"
    multi_anchor: str = "tuple"
    seed: int = 0
    representative: str = "max_score"
    block_size: int | None = None
    scope: str = "layer"
    anchors: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_budgets != "uniform":
            raise ConfigError(
                "head_budgets", self.head_budgets, "uniform (KVCrush keeps the same tokens in every head)"
            )
        assert self.budget is not None
        room = self.budget - self.sink_tokens - self.recent_tokens
        if self.representatives is not None:
            check_int("representatives", self.representatives, 0, room)
        check_choice("selection", self.selection, ("snapkv", "h2o"))
        check_choice("signature", self.signature, SIGNATURES)
        modes = (self.anchor,) if isinstance(self.anchor, str) else tuple(self.anchor)
        if not modes or len(modes) > 16:
            raise ConfigError("anchor", self.anchor, "one to 16 of " + ", ".join(ANCHOR_MODES))
        for m in modes:
            check_choice("anchor", m, ANCHOR_MODES)
        object.__setattr__(self, "anchors", modes)
        check_choice("multi_anchor", self.multi_anchor, MULTI_ANCHOR)
        check_int("seed", self.seed, 0, 2**31 - 1)
        check_choice("representative", self.representative, REPRESENTATIVES)
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1, 4096)
        check_choice("scope", self.scope, SCOPES)

    def scoring_mode(self) -> str:
        """``selection``: SnapKV's window (the default) or H2O's sums over every prompt row (the
        field was read by nothing before: every KVCrush scored by the window)."""
        return self.selection

    def reserved_spans(self) -> int:
        """Whole spans of representatives (a block-wise selection rounds them down; a negative
        count is refused by ``__post_init__`` after the span check)."""
        return max(self.n_representatives, 0) // self.block_size if self.block_size else 0

    @property
    def n_representatives(self) -> int:
        """Representative slots actually used (the default resolved)."""
        assert self.budget is not None
        if self.representatives is not None:
            return self.representatives
        return (self.budget - self.sink_tokens - self.recent_tokens) // 4

    def _layer_cache_type(self) -> type[ImportanceLayerCache]:
        return KVCrushLayerCache

    def anchor_bits(self, q_heads: int) -> list[str]:
        """Each anchor as ``mean`` or its bit string (one bit per query head), drawn as the reference draws it."""
        out = []
        for i, mode in enumerate(self.anchors):
            if mode == "mean":
                out.append("mean")
                continue
            # make_anchors draws anchor i with seed + i; only its position in the tuple matters
            bits = make_anchors(torch.zeros(1, 0, q_heads, dtype=torch.bool), (mode,), self.seed + i)[0, 0]
            out.append("".join("1" if b else "0" for b in bits.tolist()))
        return out

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        fields = super().op_fields(layers, q_heads, block_size)  # block_wise, checked against the pool's
        fields.update(
            representatives=self.n_representatives,
            signature=self.signature,
            multi_anchor=self.multi_anchor,
            representative=self.representative,
            anchors=",".join(self.anchor_bits(q_heads)),
            scope=self.scope,
        )
        return fields

    def select(self, scores: torch.Tensor, anchor_draw: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """Kept token indices per batch row for per-query-head scores ``[b, H, n]`` (budget applied).

        ``anchor_draw``: the anchors' bits when ``scores`` are one KV head's group (:func:`make_anchors`).
        """
        assert self.budget is not None
        kw = dict(
            signature=self.signature,
            anchors=self.anchors,
            multi_anchor=self.multi_anchor,
            seed=self.seed,
            representative=self.representative,
            anchor_draw=anchor_draw,
        )
        reps = self.n_representatives
        if self.block_size is None:
            return [
                s.keep for s in kvcrush_select(scores, self.budget, self.sink_tokens, self.recent_tokens, reps, **kw)
            ]
        return kvcrush_select_blocks(
            scores, self.block_size, self.budget, self.sink_tokens, self.recent_tokens, reps, **kw
        )


class KVCrushLayerCache(ImportanceLayerCache):
    """Importance cache whose selection is KVCrush's: per layer (every KV head keeps the same
    tokens) or, with ``scope="head"``, per KV head from its own query group."""

    config: KVCrushConfig

    def select(self, acc: torch.Tensor, kv_heads: int) -> torch.Tensor:
        if self.config.scope == "layer":
            heads = [self.config.select(acc)] * kv_heads
        else:
            h = acc.shape[1]
            g = h // kv_heads
            heads = [self.config.select(acc[:, i * g : (i + 1) * g], anchor_draw=(h, i * g)) for i in range(kv_heads)]
        width = max(r.numel() for rows in heads for r in rows)
        if any(r.numel() != width for rows in heads for r in rows):
            raise ShapeError("KVCrush kept different token counts across the batch")  # cannot happen: same n
        keep = torch.stack([torch.stack(rows) for rows in heads], dim=1)  # [b, kv_heads, k]
        self._bump(
            "representatives_chosen", float(min(self.config.n_representatives, max(acc.shape[2] - self.budget, 0)))
        )
        return keep

    def _chunk_scores(self, per_head: torch.Tensor) -> torch.Tensor:
        """One ranking of the layer's chunks with ``scope="layer"``: every head drops the same ones."""
        if self.config.scope == "layer":
            return per_head.sum(1, keepdim=True).expand_as(per_head)
        return per_head
