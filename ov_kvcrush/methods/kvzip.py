"""KVzip: query-agnostic eviction, each token scored by what a reconstruction of the context needs.

Paper: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416 (NeurIPS 2025).

Every other selecting method here scores tokens by the queries seen so far: after a chat turn
that only says "Reply with OK", those queries never looked at the document, and what a later
question needs is gone (issue 25: SnapKV and KVCrush answered 0/6 needles asked in the next
turn, the full cache 6/6). KVzip asks the model itself which tokens it needs to *repeat* the
context: once the prompt is prefilled, a **scoring pass** feeds a repeat prompt followed by the
context again, attending the cached keys/values; each cached token's importance is the largest
attention probability any reconstruction query gives it (over the query heads sharing its KV
head). The pass's own keys/values are discarded. Then the cache keeps the highest-scoring tokens
over **all layers and heads together** (one threshold), so heads and layers that the
reconstruction barely uses give their room to those it needs.

How a pass runs (both engines; the engine feeds the inputs, the caches score):

* the context (the tokens not scored yet) is cut into chunks of about ``chunk_tokens``, sized
  so that every step but the last feeds a multiple of ``step_multiple`` (128) ids: OpenVINO's CPU
  matmuls (AMX, weight-compressed) run such row counts 20-40 % faster per token than their
  neighbours (544 rows cost more than 640 here), and a pass is mostly matmuls; the last chunk
  takes the rest. ``step_multiple=1`` cuts ``round(n / chunk_tokens)`` equal chunks. Chunk ``i`` is
  fed as ``repeat prompt + generation prefix + chunk``, the repeat prompt of a later chunk ending
  with the previous chunk's last ``overlap_tokens`` tokens ("... starting with");
* the chunk's queries attend everything held plus, causally, the chunk itself, at the positions
  after the last token seen; the pass's tokens are then dropped and the positions reused;
* after the last chunk, :meth:`KVzipConfig.finish_scoring_pass` keeps
  ``sum over layers of budget x kv_heads`` tokens (the budget is the average per layer and head):
  every head's first ``sink_tokens`` and last ``recent_tokens`` tokens, then the top scores.

Where this departs from the paper (and kvpress 0.5.5, which we compared against):

* A scoring step's queries **attend** only the sinks, the chunk they repeat and themselves, in
  every layer. The paper's implementation (and kvpress) scores over exactly that subsample but
  runs the model's forward over the whole cache; attending the subsample makes the pass cost
  about one prefill of the context whatever its length (each chunk attends about two chunks of
  keys), where attending everything costs twice a prefill (issue 25: TTFT at most 2x the full
  cache's). Each step scores only the tokens of its chunk, as the paper's chunked scoring.
* On a model with sliding-window layers (Gemma 3) the selection is over the **global layers**
  only; a pass's steps go through a local layer as a decode step would (its window and
  themselves), and the local layers keep their window. The paper's models have no such layers.
* ``chunk_tokens`` is 512 by default, not 2048: each chunk's queries score its own tokens, so the
  work grows with the chunk; 512 keeps the pass within a prefill here.
* A conversation is compressed at the end of every prompt (chat turn) that leaves the cache
  more than ``slack_tokens`` (128) per head above its budget; the pass reconstructs only the
  tokens not scored yet (the answers and turns since the last pass), older tokens keep their
  scores. The paper compresses one context once and appends the questions uncompressed, as the
  slack does for a short turn: it is answered over the compressed cache plus itself, and its
  first token does not wait for a pass (on 12 needles of 3k tokens in the chat flow the answers
  were the same with and without the slack: 7/12, the full cache 9/12). Generated tokens are kept
  until the next pass.
* ``allocation="layer"`` (kvpress's ``layerwise``) keeps ``budget x kv_heads`` per layer, shared
  by its heads; the paper's global threshold is the default.
* Sinks (4 by default, as kvpress) and an optional recent window are always kept.
* Over the 2-/4-bit store (``quant``), a prompt and the tokens generated after it stay in full
  precision until a scoring pass has selected; then each head quantizes the largest multiple of
  ``quant.residual_tokens`` of what it keeps (the rest stays full precision). Quantized tokens are
  frozen: a later turn's pass keeps them (they count against the budget) and selects among the
  newer ones. A later pass's steps attend the quantized sinks, dequantized. No prompt tail is
  pinned (``quant.prompt_tail`` 0): the question comes after the pass. The paper stores its kept
  tokens as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ov_kvcrush.methods.attention import cap_logits, check_kv, check_query
from ov_kvcrush.methods.base import LayerCache, check_layer
from ov_kvcrush.methods.importance import EvictionConfig
from ov_kvcrush.methods.runtimes import TWO_BIT_STORE, Declaration
from ov_kvcrush.methods.store import QuantStore, StoredLayerCache, make_store
from ov_kvcrush.validation import check_choice, check_int

#: the first chunk's repeat prompt (the paper's wording)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
#: a later chunk's, followed by the previous chunk's last tokens
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: how the cache's budget is shared (see :func:`select_kept`)
ALLOCATIONS = ("global", "layer")


@dataclass(frozen=True)
class ScoringStep:
    """One step of a scoring pass: the ids fed, and the context tokens ``[lo, hi)`` (counted from
    the first token the pass scores) whose scores it updates: the chunk it asks to repeat."""

    ids: list[int]
    lo: int
    hi: int


@dataclass(frozen=True)
class KVzipConfig(EvictionConfig):
    """KVzip: query-agnostic; tokens scored by a reconstruction of the context, one threshold over all heads.

    Attributes:
        budget: tokens kept per layer and KV head on average (the cache keeps ``budget`` times
            layers times KV heads in all, shared unevenly). Required.
        sink_tokens: first tokens every head keeps (4, as kvpress); a scoring step attends them.
        recent_tokens: newest tokens every head keeps (0: the paper keeps none).
        chunk_tokens: context tokens reconstructed per scoring pass step, about (512; the paper 2048);
            bounds the pass's memory and work on long contexts.
        overlap_tokens: a later chunk's repeat prompt ends with the previous chunk's last tokens.
        allocation: ``global`` (one threshold over every layer and head, the paper) or ``layer``
            (each layer keeps ``budget x kv_heads``, shared by its heads).
        slack_tokens: a pass runs once the cache holds more than ``budget + slack_tokens`` per
            layer and KV head on average (128): a short chat turn (a question) is answered over
            the compressed cache plus itself, whole; a long one (a document) is compressed.
        step_multiple: each step of a pass but the last feeds a multiple of this many ids (128:
            OpenVINO's CPU matmuls run such row counts 20-40 % faster per token here); 1: equal
            chunks of about ``chunk_tokens``.
        quant: keep the selected tokens in the 2-/4-bit store (``None``: full precision); see
            the module's notes for when they are quantized.
    """

    name: ClassVar[str] = "kvzip"
    departure: ClassVar[str] = "scoring chunks of 512 tokens attending a subsample (paper: 2048, the whole cache)"
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cpu-op": (),
        "gpu-plugin": (TWO_BIT_STORE,),
    }
    scoring_pass: ClassVar[bool] = True
    pins_prompt_tail: ClassVar[bool] = False
    sink_tokens: int = 4
    recent_tokens: int = 0
    chunk_tokens: int = 512
    overlap_tokens: int = 8
    allocation: str = "global"
    slack_tokens: int = 128
    step_multiple: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_tokens", self.chunk_tokens, 16, 1 << 16)
        check_int("slack_tokens", self.slack_tokens, 0, 1 << 20)
        check_int("overlap_tokens", self.overlap_tokens, 0, 256)
        check_int("step_multiple", self.step_multiple, 1, 4096)
        check_choice("allocation", self.allocation, ALLOCATIONS)
        if self.quant is not None:
            self.quant.pinned_tail(selecting=self.pins_prompt_tail)  # a bad value is named at config time

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        return {"sinks": self.sink_tokens, "recent": self.recent_tokens, "allocation": self.allocation}

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        return KVzipLayerCache(self)

    def scoring_pass_due(self, held: int, layers: int, kv_heads: int) -> bool:
        """Whether a cache holding ``held`` tokens (summed over layers and KV heads) is over its
        budget by more than ``slack_tokens`` per layer and head."""
        assert self.budget is not None
        return held > (self.budget + self.slack_tokens) * layers * kv_heads

    def scoring_pass_inputs(
        self, context: Sequence[int], encode: Callable[[str], list[int]], prefix: Sequence[int]
    ) -> list[ScoringStep]:
        """The steps of a scoring pass over ``context`` (the ids to reconstruct): each step's ids
        and the context tokens it scores, ``[lo, hi)`` from the context's start.

        ``encode`` turns text into ids without a template; ``prefix`` is what the chat template puts
        before an answer (the generation prompt), so the model answers the repeat request.
        """
        n = len(context)
        if not n:
            return []
        first = len(encode(REPEAT_PROMPT)) + len(prefix)  # what a step feeds besides its chunk
        later = len(encode(CONTINUE_PROMPT)) + self.overlap_tokens + len(prefix)
        bounds = self._chunk_bounds(n, first, later)
        chunks = [list(context[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1)]
        steps = []
        for i, chunk in enumerate(chunks):
            if i == 0:
                ask = encode(REPEAT_PROMPT)
            else:
                tail = chunks[i - 1][-self.overlap_tokens :] if self.overlap_tokens else []
                ask = encode(CONTINUE_PROMPT) + tail
            steps.append(ScoringStep([*ask, *prefix, *chunk], bounds[i], bounds[i + 1]))
        return steps

    def _aligned_step(self, ask: int) -> int:
        """The ids a step feeds (a multiple of ``step_multiple``) when its request takes ``ask``."""
        m = self.step_multiple
        return m * max(ask // m + 1, round((self.chunk_tokens + ask) / m))

    def _chunk_bounds(self, n: int, first: int, later: int) -> list[int]:
        """Where the chunks of an ``n``-token context start and end (``first``/``later``: the ids a
        first/later step feeds besides its chunk)."""
        if self.step_multiple == 1:  # equal chunks of about chunk_tokens (at most 1.5 x)
            parts = max(1, round(n / self.chunk_tokens))
            return [n * i // parts for i in range(parts + 1)]
        bounds = [0]
        while bounds[-1] < n:  # whole steps of a multiple of step_multiple; the last takes the rest
            ask = later if len(bounds) > 1 else first
            bounds.append(min(n, bounds[-1] + self._aligned_step(ask) - ask))
        return bounds

    def scoring_step_bound(self, encode: Callable[[str], list[int]], prefix: Sequence[int]) -> int:
        """The most ids one step of :meth:`scoring_pass_inputs` feeds: what a pool must have free
        beside the sequence for a pass."""
        first = len(encode(REPEAT_PROMPT)) + len(prefix)
        later = len(encode(CONTINUE_PROMPT)) + self.overlap_tokens + len(prefix)
        if self.step_multiple == 1:  # a chunk is at most 1.5 x chunk_tokens
            return max(first, later) + (3 * self.chunk_tokens + 1) // 2
        return max(self._aligned_step(first), self._aligned_step(later))

    def finish_scoring_pass(self, layers: list[LayerCache]) -> None:
        """Keep the budget over ``layers`` (this method's caches, in layer order) by their scores."""
        caches = [lc for lc in layers if isinstance(lc, KVzipLayerCache)]
        if not caches:
            return
        assert self.budget is not None
        scores = [lc.selection_scores() for lc in caches]
        kept = select_kept(scores, self.budget, self.allocation)
        for lc, keep in zip(caches, kept, strict=True):
            lc.keep_mask(keep)
            lc.quantize_kept()


def select_kept(scores: list[torch.Tensor], budget: int, allocation: str) -> list[torch.Tensor]:
    """Which slots each layer keeps: ``[b, hk, n_l]`` bool per layer.

    ``scores`` per layer ``[b, hk, n_l]``: ``+inf`` for protected slots (sinks, recent), ``-inf``
    for padding. Keeps ``budget x hk`` per layer (``layer``) or their sum over all layers
    (``global``), the highest scores first, ties to the lower (layer, head, slot). A layer or cache
    holding no more than that keeps everything.
    """
    check_choice("allocation", allocation, ALLOCATIONS)
    groups = [[i] for i in range(len(scores))] if allocation == "layer" else [list(range(len(scores)))]
    kept = [torch.zeros_like(s, dtype=torch.bool) for s in scores]
    for group in groups:
        flat = torch.cat([scores[i].flatten(1) for i in group], dim=1).float()  # [b, sum hk*n]
        total = sum(budget * scores[i].shape[1] for i in group)
        valid = int((flat > float("-inf")).sum(-1).max()) if flat.numel() else 0
        k = min(total, flat.shape[1])
        if valid <= total:
            order = torch.arange(flat.shape[1], device=flat.device).expand(flat.shape[0], -1)
            chosen = flat > float("-inf")
        else:
            order = torch.argsort(flat, dim=-1, descending=True, stable=True)[:, :k]
            chosen = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, order, True) & (flat > float("-inf"))
        start = 0
        for i in group:
            size = scores[i][0].numel()
            kept[i] = chosen[:, start : start + size].reshape(scores[i].shape)
            start += size
    return kept


def max_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    key_mask: torch.Tensor,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[b, hk, n]``: each key's largest attention probability from any query (and any query head
    of its KV head's group), under the causal full softmax (of logits soft-capped by ``softcap``,
    :func:`~ov_kvcrush.methods.attention.cap_logits`); float32, in query chunks."""
    g = check_query(queries, keys)
    b, hq, t, d = queries.shape
    hk, n = keys.shape[1], keys.shape[2]
    scale = d**-0.5 if scale is None else scale
    best = torch.zeros(b, hk, n, device=keys.device)
    kf = keys.float().transpose(-1, -2)
    rows = max(1, (1 << 24) // max(1, b * hq * n))
    for s in range(0, t, rows):
        q = (queries[:, :, s : s + rows].float() * scale).reshape(b, hk, -1, d)  # [b, hk, g*r, d]
        logits = cap_logits(torch.matmul(q, kf).view(b, hk, g, -1, n), softcap)
        qp = q_positions[s : s + rows].view(1, 1, 1, -1, 1)
        allowed = (k_positions[:, :, None, None, :] <= qp) & key_mask[:, :, None, None, :]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        best = torch.maximum(best, probs.amax(dim=(2, 3)))
    return best


class KVzipLayerCache(StoredLayerCache):
    """One layer of KVzip: everything seen is held until a scoring pass selects.

    State: the full-precision store (tokens and positions; heads padded with ``-1`` positions once
    they keep different counts) and ``score`` ``[b, hk, n]``: each held token's largest
    reconstruction attention (0 until a pass scores it).
    """

    def __init__(self, config: KVzipConfig) -> None:
        super().__init__()
        self.config = config
        self.store = make_store(config.quant, deferred=True)
        self.score: torch.Tensor | None = None

    # ---- protocol
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        out = self._attend(queries, keys, values, q_positions=pos, k_positions=pos).output
        self.store.append(keys, values, pos)
        self.score = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2], device=keys.device)
        return out

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._positions(keys.shape[2], keys.device)
        self.store.append(keys, values, pos)
        assert self.score is not None
        self.score = torch.cat([self.score, self.score.new_zeros(*keys.shape[:2], keys.shape[2])], dim=2)
        k, v, p = self.store.dense()
        return self._attend(queries, k, v, q_positions=pos, k_positions=p, key_mask=p >= 0).output

    def score_step(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scored: tuple[int, int]
    ) -> torch.Tensor:
        """One step of the scoring pass: the step's queries attend the held tokens at positions in
        ``scored`` (``[lo, hi)``: the chunk the step repeats), the sinks, and the step's own keys
        (causal, at the positions after the last seen); each held token of the chunk takes the
        largest probability it gets if larger than its score. Nothing of the step is kept; the
        output is returned."""
        check_kv(keys, values)
        check_query(queries, keys)
        assert self.score is not None
        t = keys.shape[2]
        pos = torch.arange(self.seen, self.seen + t, device=keys.device)
        hk_, hv_, hp = self.store.dense()
        k = torch.cat([hk_, keys], dim=2)
        v = torch.cat([hv_, values], dim=2)
        p = torch.cat([hp, pos.expand(*keys.shape[:2], t)], dim=2)
        inside = (hp >= scored[0]) & (hp < scored[1])
        seen_ = (hp >= 0) & (inside | (hp < min(self.config.sink_tokens, scored[0])))
        mask = torch.cat([seen_, torch.ones(*keys.shape[:2], t, dtype=torch.bool, device=keys.device)], dim=2)
        out = self._attend(queries, k, v, q_positions=pos, k_positions=p, key_mask=mask).output
        best = max_attention(queries, k, pos, p, mask, self.scale, self.softcap)[..., : hp.shape[2]]
        self.score = torch.where(inside, torch.maximum(self.score, best), self.score)
        return out

    def selection_scores(self) -> torch.Tensor:
        """``[b, hk, n]`` what the selection ranks: the scores, ``+inf`` for sinks and the recent
        window, ``-inf`` for padding."""
        assert self.score is not None
        p = self.store.positions
        assert p is not None
        s = self.score.float().masked_fill(p < 0, float("-inf"))
        held = (p >= 0).sum(-1, keepdim=True)
        rank = torch.cumsum((p >= 0).long(), dim=-1) - 1  # slot's order among held slots
        protected = (p >= 0) & ((p < self.config.sink_tokens) | (rank >= held - self.config.recent_tokens))
        nq = self._frozen_slots()
        protected[:, :, :nq] |= p[:, :, :nq] >= 0  # quantized: kept
        return s.masked_fill(protected, float("inf"))

    def _frozen_slots(self) -> int:
        """The first slots of every head that no selection may drop: the quantized tokens."""
        return self.store.quantized_tokens if isinstance(self.store, QuantStore) else 0

    def quantize_kept(self) -> None:
        """After a selection: over the 2-/4-bit store, quantize what each head keeps (whole
        ``residual_tokens`` runs of it; :meth:`QuantStore.flush_heads`)."""
        if not isinstance(self.store, QuantStore):
            return
        assert self.score is not None
        nq = self.store.quantized_tokens
        index = self.store.flush_heads()
        if index is not None:  # the residual was laid out anew: its scores follow
            tail = torch.cat([self.score[:, :, nq:], self.score.new_zeros(*self.score.shape[:2], 1)], dim=2)
            self.score = torch.cat([self.score[:, :, :nq], torch.gather(tail, 2, index)], dim=2)

    def keep_mask(self, keep: torch.Tensor) -> None:
        """Keep the slots marked in ``keep`` ``[b, hk, n]`` (heads keep different counts: padded
        with ``-1`` positions), in slot order."""
        assert self.score is not None
        keep = keep.clone()
        keep[:, :, : self._frozen_slots()] = True  # quantized slots (their padding too) stay
        n = keep.shape[-1]
        width = max(1, int(keep.sum(-1).max()))
        slot = torch.arange(n, device=keep.device)
        order = torch.sort(torch.where(keep, slot, torch.full_like(slot, n)), dim=-1).values[..., :width]
        index = torch.where(order < n, order, torch.full_like(order, -1))
        valid = self._keep_padded(index)
        self.score = torch.gather(self.score, 2, index.clamp_min(0)).masked_fill(~valid, 0.0)

    def _metadata_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.score,)


__all__ = ["KVzipConfig", "KVzipLayerCache", "max_attention", "select_kept"]
