"""Importance baselines: StreamingLLM, H2O, SnapKV, PyramidKV (and MiniKV's pyramid), per-head budgets.

Every method here keeps, per layer and KV head, ``sink_tokens`` first tokens, ``recent_tokens``
last tokens and the highest-scoring tokens in between, ``budget`` in all:

* **StreamingLLM** keeps only sinks and the recent window (no scores).
* **H2O** scores a token by the attention it has accumulated from every query so far (summed
  over the query heads that share the KV head).
* **SnapKV** scores prompt tokens by the attention of the last ``window`` prompt queries only,
  smoothed with a 1-D pooling over neighbouring tokens (kernel ``pool_kernel``), so a kept token
  brings its neighbours' context. After the prompt, decode queries keep adding to the scores
  (H2O-style), so the budget holds during generation too.
* **PyramidKV** gives lower layers more budget than upper ones, linearly, keeping the total
  over layers (see :func:`pyramid_budgets`).
* ``head_budgets="adaptive"`` lets heads of a layer share its budget unevenly (AdaKV): the
  layer keeps the ``heads x heavy`` tokens with the highest normalised scores over all heads,
  each head at least ``min_head_tokens`` (see :func:`adaptive_head_budgets`).

Eviction runs after the prompt and whenever the layer holds more than its budget. Over the 2-/4-bit
store (``quant``) quantized key groups cannot lose members, so decode steps evict whole quantized
chunks (``quant.residual_tokens`` tokens, the unit the store quantizes together): once a head holds
at least one chunk more than its budget, its lowest-scoring chunks go (their tokens' accumulated
scores summed), never one holding a sink or one of the ``recent_tokens`` newest tokens. A head
therefore stays within a chunk of its budget (plus, for a few steps, the recent tokens a fresh
chunk holds), where a frozen selection kept every generated token (a chat or a long answer grew
without bound).
KVCrush does the same (one ranking per layer with its per-layer scope); MiniKV
(``frozen_selection``), Knorm and adaptive head budgets stay frozen over the store.

Papers:

* StreamingLLM: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
  arXiv 2309.17453.
* H2O: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
  Language Models", arXiv 2306.14048.
* SnapKV: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
  arXiv 2404.14469.
* PyramidKV: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
  Funneling", arXiv 2406.02069.
* Adaptive head budgets: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
  Allocation for Efficient LLM Inference", arXiv 2407.11550.

Where this departs from them:

* Every method keeps ``sink_tokens`` and ``recent_tokens`` (H2O's paper keeps only a recent
  window; SnapKV keeps its observation window, which is our recent window).
* H2O scores are summed over the query heads sharing a KV head (grouped-query models; the paper
  predates GQA) and never decay.
* SnapKV keeps evicting during decoding with the accumulated scores (the paper compresses the
  prompt once), so the budget holds for long generations too.
* SnapKV pools over 31 tokens by default, not the paper's 7 (``pool_kernel=7`` restores it): the
  window attends the words before a needle, and only a wide pool carries their score over the
  whole number (see :attr:`SnapKVConfig.pool_width`).
* Over the quantized store, decode-time eviction drops whole ``residual_tokens`` chunks (MiniKV
  freezes the prefill selection; KIVI-style per-channel key groups cannot lose single tokens).
* PyramidKV's per-layer budgets are linear in depth (the paper's arithmetic schedule) with the
  total preserved exactly by largest-remainder rounding; its attention-entropy variant is not
  implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import LogitMap, group_heads
from ov_kvcrush.methods.base import LayerCache, MethodConfig, QuantSettings, check_layer, gather_tokens
from ov_kvcrush.methods.runtimes import ADAPTIVE_HEAD_BUDGETS, SPANS, TWO_BIT_STORE, Declaration
from ov_kvcrush.methods.selection import (
    HEAD_BUDGETS,
    POOLS,
    SCORINGS,
    adaptive_head_budgets,
    keep_block_indices,
    keep_chunk_indices,
    keep_indices,
    keep_indices_ragged,
    pyramid_budgets,
    snapkv_scores,
    span_budget_floor,
)
from ov_kvcrush.methods.store import QuantStore, StoredLayerCache, make_store
from ov_kvcrush.validation import check_budget, check_choice, check_float, check_int

# --------------------------------------------------------------------------------------------
# configs


#: where H2O's selection and its kin run: the fast paths and the GPU paths keep single tokens under
#: uniform head budgets, our op takes spans but not adaptive budgets
SELECTION_RUNTIMES: Declaration = {
    "reference": (),
    "cuda": (TWO_BIT_STORE, ADAPTIVE_HEAD_BUDGETS, SPANS),
    "cpu-op": (ADAPTIVE_HEAD_BUDGETS,),
    "gpu-plugin": (ADAPTIVE_HEAD_BUDGETS, SPANS),
    "gpu-pool": (ADAPTIVE_HEAD_BUDGETS, SPANS),
}


@dataclass(frozen=True)
class EvictionConfig(MethodConfig):
    """Fields shared by the methods that keep ``budget`` tokens per layer and KV head.

    Attributes:
        budget: tokens kept per layer and KV head, sinks and recent included (for pyramids, the
            average over layers). Required.
        sink_tokens: first tokens always kept (attention sinks).
        recent_tokens: newest tokens always kept.
        quant: store the kept tokens in MiniKV's 2-bit format (``None``: full precision).
    """

    budget: int | None = None
    sink_tokens: int = 16
    recent_tokens: int = 64
    quant: QuantSettings | None = None

    def store_settings(self) -> QuantSettings | None:
        return self.quant

    def __post_init__(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("recent_tokens", self.recent_tokens, 0)
        floor = self.sink_tokens + self.recent_tokens
        check_budget(
            "budget", self.budget, max(floor, 1), f" for method {self.name} (sink_tokens + recent_tokens = {floor})"
        )
        if self.quant is not None and not isinstance(self.quant, QuantSettings):
            raise ConfigError("quant", self.quant, "a QuantSettings or None")
        if self.quant is not None:
            self.quant.pinned_tail(selecting=self.pins_prompt_tail)  # a bad value is named at config time

    #: whether, over the quantized store, decode steps evict whole quantized chunks (StreamingLLM,
    #: H2O, SnapKV, PyramidKV, KVCrush); the others keep the prefill selection there
    evicts_quantized_chunks: ClassVar[bool] = False
    #: the prefill selection is never revisited, whatever the store (MiniKV)
    frozen_selection: ClassVar[bool] = False
    #: how tokens are scored: ``none`` (StreamingLLM), ``h2o``, ``snapkv`` or ``knorm``
    scoring: ClassVar[str] = "none"
    #: whether decode steps add their attention to the scores (Knorm scores keys by their norm)
    decode_attention_scores: ClassVar[bool] = True

    # The steps a method of this family changes by overriding one of them (never by a field
    # probed from here): how it scores, and how it selects (spans, per-head budgets).

    def scoring_mode(self) -> str:
        """The scores this config's caches evict by (PyramidKV and MiniKV pick with ``selection``)."""
        return self.scoring

    def prompt_scores(
        self, queries: torch.Tensor, keys: torch.Tensor, attention_scores: torch.Tensor | None, logit: LogitMap
    ) -> torch.Tensor:
        """``[b, hq, t]`` scores of a prompt's tokens, the selection's input (per query head):
        H2O's are the attention every query gave them (``attention_scores``); without a rule, zeros."""
        if self.scoring_mode() == "h2o":
            assert attention_scores is not None
            return attention_scores
        return torch.zeros(queries.shape[0], queries.shape[1], keys.shape[2], device=queries.device)

    def new_token_scores(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[b, hq, t]`` starting scores of a decode step's tokens (their attention comes on top)."""
        return torch.zeros(queries.shape[0], queries.shape[1], keys.shape[2], device=keys.device)

    def head_budget_mode(self) -> str:
        """``uniform`` (every head keeps the layer's budget) or ``adaptive`` (heads share it)."""
        return "uniform"

    def min_heavy_tokens(self) -> int:
        """With adaptive head budgets, the fewest heavy tokens a head keeps."""
        return 0

    def span_tokens(self) -> int | None:
        """Tokens per span a block-wise selection keeps whole (``None``: single tokens)."""
        return None

    def selection_frozen(self) -> bool:
        """Whether the prefill selection is final: MiniKV's, and over the quantized store that of
        every method that cannot evict whole quantized chunks (adaptive head budgets included)."""
        if self.frozen_selection:
            return True
        if self.quant is None:
            return False
        return not self.evicts_quantized_chunks or self.head_budget_mode() != "uniform"


@dataclass(frozen=True)
class StreamingLLMConfig(EvictionConfig):
    """StreamingLLM: attention sinks plus a sliding window; ``recent_tokens`` is ``budget - sink_tokens``.

    Attributes:
        sink_tokens: 4 by default, as in the StreamingLLM paper.
        recent_tokens: ignored (derived from the budget); kept for a uniform interface.
    """

    name: ClassVar[str] = "streamingllm"
    departure: ClassVar[str] = "the paper's"
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cuda": (TWO_BIT_STORE,),
        "cpu-op": (),
        "gpu-plugin": (TWO_BIT_STORE,),
        "gpu-pool": (TWO_BIT_STORE,),
    }
    evicts_quantized_chunks: ClassVar[bool] = True
    sink_tokens: int = 4
    recent_tokens: int = 0

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        assert self.budget is not None
        recent = self.budget - self.sink_tokens
        return {
            "sinks": self.sink_tokens,
            "recent": recent,
            "scoring": "none",
            "frozen": int(self.selection_frozen()),
            "block_wise": 0,
        }

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        assert self.budget is not None
        recent = self.budget - self.sink_tokens
        return ImportanceLayerCache(self, budget=self.budget, sinks=self.sink_tokens, recent=recent)


@dataclass(frozen=True)
class H2OConfig(EvictionConfig):
    """H2O: heavy hitters by accumulated attention.

    Attributes:
        head_budgets: ``uniform`` (every head keeps ``budget``) or ``adaptive`` (heads share the
            layer's budget by their score concentration).
        min_head_tokens: with adaptive budgets, the fewest heavy tokens a head keeps.
        block_size: ``None`` keeps single tokens; a size keeps whole spans of that many tokens
            (scores summed per span, the trailing partial span always kept), as paged attention
            evicts (native OpenVINO GenAI keeps 32-token blocks). A token-granular selection
            keeps a needle's digits one by one and loses some (issue 24: our token-wise SnapKV
            answered 1/16 passkeys at 4k where native's blocks answered 16/16); a span keeps
            them together. The op needs the engine's KV block size.
    """

    name: ClassVar[str] = "h2o"
    departure: ClassVar[str] = "the paper's, with sinks kept and scores summed per KV head (GQA)"
    runtimes: ClassVar[Declaration] = {**SELECTION_RUNTIMES, "genai": ()}
    evicts_quantized_chunks: ClassVar[bool] = True
    head_budgets: str = "uniform"
    min_head_tokens: int = 0
    block_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("head_budgets", self.head_budgets, HEAD_BUDGETS)
        assert self.budget is not None
        heavy = self.budget - self.sink_tokens - self.recent_tokens
        check_int("min_head_tokens", self.min_head_tokens, 0, heavy)
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1, 4096)
            if self.head_budgets != "uniform":
                raise ConfigError("block_size", self.block_size, "None with head_budgets='adaptive'")
            self.check_span_room()

    def reserved_spans(self) -> int:
        """Spans a block-wise selection sets aside beside the sinks and recent ones (KVCrush's
        representatives); none here."""
        return 0

    def budget_floor(self) -> int:
        """The smallest budget this config's selection accepts at every sequence length: the
        sinks and recent tokens, or with ``block_size`` their whole spans, the partial span being
        filled and the reserved spans (:func:`~ov_kvcrush.methods.selection.span_budget_floor`)."""
        if self.block_size is None:
            return self.sink_tokens + self.recent_tokens
        return span_budget_floor(self.block_size, self.sink_tokens, self.recent_tokens, self.reserved_spans())

    def check_span_room(self) -> None:
        """Refuses a block-wise budget with no room for its spans at some length (the selection
        would fail mid-generation, when the partial span grows)."""
        floor = self.budget_floor()
        what = "sink, recent and partial spans" + (" and representatives" if self.reserved_spans() else "")
        check_budget("budget", self.budget, floor, f" for block_size={self.block_size} ({what} = {floor})")

    scoring: ClassVar[str] = "h2o"

    def head_budget_mode(self) -> str:
        return self.head_budgets

    def min_heavy_tokens(self) -> int:
        return self.min_head_tokens

    def span_tokens(self) -> int | None:
        return self.block_size

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        if self.block_size is not None and self.block_size != block_size:
            raise ConfigError(
                "options.block_size",
                self.block_size,
                f"the engine's KV block size {block_size} (backend openvino evicts whole blocks of the pool)",
            )
        return {
            "sinks": self.sink_tokens,
            "recent": self.recent_tokens,
            "scoring": self.scoring_mode(),
            "frozen": int(self.selection_frozen()),
            "block_wise": int(self.block_size is not None),
        }

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        return self._layer_cache_type()(
            self, budget=self.layer_budget(layer_idx, num_layers), sinks=self.sink_tokens, recent=self.recent_tokens
        )

    def _layer_cache_type(self) -> type[ImportanceLayerCache]:
        return ImportanceLayerCache


#: SnapKV's own pooling width (the paper's), kept as ``pool_kernel=7``
SNAPKV_PAPER_POOL_KERNEL = 7
#: the default pooling width, over single tokens and spans alike (see :attr:`SnapKVConfig.pool_width`)
DEFAULT_POOL_KERNEL = 31


@dataclass(frozen=True)
class SnapKVConfig(H2OConfig):
    """SnapKV: prompt tokens scored by the last ``window`` queries, pooled.

    Attributes:
        window: observation window (last prompt queries). 32 as in the SnapKV paper.
        pool_kernel: odd pooling width over neighbouring tokens (1: none). ``None``: 31, for
            single tokens and spans (SnapKV's paper uses 7; see :attr:`pool_width`).
        pool: ``max`` or ``avg`` pooling.
    """

    name: ClassVar[str] = "snapkv"
    departure: ClassVar[str] = "pools over 31 tokens (paper: 7, `pool_kernel=7`) and keeps its budget while decoding"
    runtimes: ClassVar[Declaration] = {**SELECTION_RUNTIMES, "genai": ()}
    scoring: ClassVar[str] = "snapkv"
    window: int = 32
    pool_kernel: int | None = None
    pool: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 1, 1 << 16)
        if self.pool_kernel is not None:
            check_int("pool_kernel", self.pool_kernel, 1, 129)
            if self.pool_kernel % 2 == 0:
                raise ConfigError("pool_kernel", self.pool_kernel, "an odd integer in [1, 129]")
        check_choice("pool", self.pool, POOLS)

    @property
    def pool_width(self) -> int:
        """The pooling width the scores get: ``pool_kernel``, else 31 (SnapKV's paper pools over 7).

        The last queries attend a needle's opening tokens (the phrase before it, its first
        digits); the digits after them get little attention of their own. Pooled over 7 tokens
        only the first few digits inherit the phrase's score and the rest are evicted; pooled over
        31 the whole number does. Spans gain the same way: a needle that a span boundary splits
        keeps both spans. Measured on our op (docs/quality.md, docs/long_context.md): on
        SmolLM2, 12 needles at 3k, budget 1024 (full cache 11/12), token-wise SnapKV answers 11/12
        with 31 and 1/12 with 7, token-wise KVCrush 10/12 and 4/12, 32-token spans 11/12 and 8/12;
        on Gemma 3 at 32k, budget 2048, token-wise SnapKV answers 6/6 with 31 (full 6/6).
        """
        return DEFAULT_POOL_KERNEL if self.pool_kernel is None else self.pool_kernel

    def prompt_scores(
        self, queries: torch.Tensor, keys: torch.Tensor, attention_scores: torch.Tensor | None, logit: LogitMap
    ) -> torch.Tensor:
        """SnapKV's: the attention of the last ``window`` queries, pooled over ``pool_width`` tokens."""
        if self.scoring_mode() != "snapkv":
            return super().prompt_scores(queries, keys, attention_scores, logit)
        return snapkv_scores(queries, keys, self.window, self.pool_width, self.pool, logit.scale, logit.softcap)

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        fields = super().op_fields(layers, q_heads, block_size)
        if self.scoring_mode() == "snapkv":  # the window and pooling score the prompt
            fields.update(window=self.window, pool_kernel=self.pool_width, pool=self.pool)
        return fields


@dataclass(frozen=True)
class PyramidKVConfig(SnapKVConfig):
    """PyramidKV: SnapKV scoring with per-layer budgets decreasing linearly with depth.

    Attributes:
        pyramid_depth: ratio of the average heavy budget to the top layer's (>= 1; 1 is uniform).
            The bottom layer gets ``2 - 1/depth`` times the average.
        selection: ``snapkv`` (PyramidKV) or ``h2o`` (MiniKV's cumulative scores).
    """

    name: ClassVar[str] = "pyramidkv"
    departure: ClassVar[str] = "the paper's linear schedule (no entropy variant)"
    runtimes: ClassVar[Declaration] = SELECTION_RUNTIMES
    pyramid_depth: float = 4.0
    selection: str = "snapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("pyramid_depth", self.pyramid_depth, 1.0, 1e6)
        check_choice("selection", self.selection, SCORINGS)

    def scoring_mode(self) -> str:
        return self.selection

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        assert self.budget is not None
        floor = self.budget_floor()
        return floor + pyramid_budgets(self.budget - floor, num_layers, self.pyramid_depth)[layer_idx]


# --------------------------------------------------------------------------------------------
# per-layer cache


class ImportanceLayerCache(StoredLayerCache):
    """Keeps ``budget`` tokens per KV head by score; subclasses change only :meth:`select`.

    How tokens are scored is the config's (:meth:`EvictionConfig.prompt_scores`,
    :meth:`~EvictionConfig.new_token_scores`), and so is how they are selected (spans, per-head
    budgets): the cache runs the steps. State: a store of kept tokens, and ``acc`` ``[b, hq, n]``
    float32, each kept token's accumulated attention per *query* head (KVCrush needs the
    per-query-head view).
    """

    def __init__(self, config: EvictionConfig, *, budget: int, sinks: int, recent: int) -> None:
        super().__init__()
        self.config = config
        self.budget = budget
        self.sinks = sinks
        self.recent = recent
        self.scoring = config.scoring_mode()
        self.store = make_store(config.quant)
        self.acc: torch.Tensor | None = None
        self.adaptive = config.head_budget_mode() == "adaptive"
        self.head_budget: torch.Tensor | None = None  # [b, hk] per-head budgets (adaptive only)
        self.frozen = False

    # ---- selection hook
    def select(self, acc: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Per-KV-head indices ``[b, hk, k]`` to keep from the ``n`` tokens scored by ``acc`` ``[b, hq, n]``.

        May pad with ``-1`` (adaptive head budgets); padded slots are dropped from attention.
        """
        if self.scoring == "none":
            scores = torch.zeros(acc.shape[0], kv_heads, acc.shape[2], device=acc.device)
        else:
            scores = group_heads(acc, kv_heads)
        if not self.adaptive:
            span = self.config.span_tokens()
            if span is not None:
                return keep_block_indices(scores, self.budget, self.sinks, self.recent, span)
            return keep_indices(scores, self.budget, self.sinks, self.recent)
        return self._select_adaptive(scores)

    def _select_adaptive(self, scores: torch.Tensor) -> torch.Tensor:
        b, h, n = scores.shape
        if self.head_budget is None:  # first eviction (prefill): share the layer budget between heads
            s, r = self.sinks, self.recent
            heavy = self.budget - s - r
            counts = adaptive_head_budgets(scores[..., s : n - r], heavy * h, self.config.min_heavy_tokens())
            self.head_budget = counts + s + r
        lengths = self.store.positions.ge(0).sum(-1) if len(self.store) else torch.full((b, h), n)
        return keep_indices_ragged(scores, lengths.to(scores.device), self.head_budget, self.sinks, self.recent)

    # ---- protocol
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        t = keys.shape[2]
        # Only H2O scores the prompt with every query; SnapKV scores it with its window, and
        # StreamingLLM not at all, so they skip materialising the prompt's attention matrix.
        res = self._attend(queries, keys, values, q_positions=pos, k_positions=pos, return_scores=self.scoring == "h2o")
        acc = self.config.prompt_scores(queries, keys, res.scores, LogitMap(self.scale, self.softcap))
        hk = keys.shape[1]
        if t > self.budget:
            index = self.select(acc, hk)
            keys, values, p, acc = self._gather(keys, values, pos.expand(keys.shape[0], hk, t), acc, index)
            self._bump("evicted", float((t - (index >= 0).sum(-1)).sum()))
        else:
            p = pos
        quant = self.config.quant
        pin = 0 if quant is None else quant.pinned_tail(selecting=self.config.pins_prompt_tail)
        self.store.append(keys, values, p, pin=pin)
        self.frozen = self.config.selection_frozen()
        self.acc = self._in_store_order(acc, p) if self._store_reorders() else acc
        return res.output

    def _store_reorders(self) -> bool:
        """Whether the scores must follow the store's order: the quantized store reads back
        quantized, pinned, then residual tokens, so pinning the prompt's tail and each flush
        reorder what it holds; an evicting selection over it ranks by these scores (a frozen one
        never reads them again)."""
        return isinstance(self.store, QuantStore) and not self.frozen

    def _in_store_order(self, acc: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``acc`` (per token of ``positions`` ``[n]`` or ``[b, hk, n]``, in that order) in the store's order."""
        index = self.store.order_of(positions)  # a QuantStore (_store_reorders)
        return acc if index is None else self.gather_scores(acc, index)

    def _gather(self, keys, values, pos, acc, index):
        valid = index >= 0
        safe = index.clamp_min(0)
        k = gather_tokens(keys, safe)
        v = gather_tokens(values, safe)
        p = torch.where(valid, torch.gather(pos, 2, safe), torch.full_like(safe, -1))
        return k, v, p, self.gather_scores(acc, index)

    @staticmethod
    def gather_scores(acc: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Per-q-head scores ``[b, hq, n]`` of the per-KV-head ``index`` (``-1`` pads get ``-inf``)."""
        g = acc.shape[1] // index.shape[1]
        a = torch.gather(acc, 2, index.clamp_min(0).repeat_interleave(g, dim=1))
        return torch.where((index >= 0).repeat_interleave(g, dim=1), a, torch.full_like(a, float("-inf")))

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        t = keys.shape[2]
        pos = self._positions(t, keys.device)
        before = self.store.positions if self._store_reorders() else None  # (a concatenation there)
        self.store.append(keys, values, pos)
        k, v, p = self.store.dense()
        res = self._attend(
            queries,
            k,
            v,
            q_positions=pos,
            k_positions=p,
            key_mask=p >= 0,
            return_scores=self.config.decode_attention_scores,
        )
        assert self.acc is not None
        acc = torch.cat([self.acc, self.config.new_token_scores(queries, keys)], dim=2)
        if before is not None:
            acc = self._in_store_order(acc, torch.cat([before, pos.expand(*before.shape[:2], t)], dim=2))
        self.acc = acc
        if res.scores is not None:
            self.acc = self.acc + res.scores.masked_fill(
                ~(p >= 0).repeat_interleave(queries.shape[1] // k.shape[1], dim=1), 0.0
            )
        if not self.frozen:
            if isinstance(self.store, QuantStore):
                self._evict_quantized_chunks()
            elif self._over_budget(p):
                self._evict(p)
        return res.output

    def _evict_quantized_chunks(self) -> None:
        """Over the quantized store: drop, per KV head, the lowest-scoring whole quantized chunks
        while the head keeps at least its budget (sinks' and recent tokens' chunks stay; ties go
        to the older chunk). Every head of these methods holds the same count, so each drops the
        same number of chunks."""
        store = self.store
        assert isinstance(store, QuantStore) and self.acc is not None
        r = store.settings.residual_tokens
        nq = store.quantized_tokens
        drop = (len(store) - self.budget) // r
        if drop <= 0 or nq == 0:
            return
        assert store.qpos is not None
        b, hk = store.qpos.shape[:2]
        score = self._chunk_scores(group_heads(self.acc[..., :nq], hk).reshape(b, hk, nq // r, r).sum(-1))
        newest = int(store.positions.max())  # type: ignore[union-attr]
        keep = keep_chunk_indices(score, store.qpos, drop, self.sinks, newest - self.recent)
        if keep.shape[-1] == score.shape[-1]:
            return
        self.acc = self.gather_scores(self.acc, store.keep_chunks(keep))
        self._bump("evicted", float((score.shape[-1] - keep.shape[-1]) * r * b * hk))

    def _chunk_scores(self, per_head: torch.Tensor) -> torch.Tensor:
        """``[b, hk, chunks]`` the scores chunks are ranked by (each KV head its own)."""
        return per_head

    def _over_budget(self, p: torch.Tensor) -> bool:
        held = (p >= 0).sum(-1)
        if self.head_budget is not None:
            return bool((held > self.head_budget).any())
        return int(held.max()) > self.budget

    def _evict(self, p: torch.Tensor) -> None:
        """Drop tokens beyond the budget (per head: adaptive budgets are ragged, padded with ``-1``)."""
        assert self.acc is not None
        hk = p.shape[1]
        if self.adaptive:
            # the new tokens landed after the pads: move valid tokens first, keeping their order
            order = torch.argsort((p < 0).to(torch.int8), dim=-1, stable=True)
            self.store.keep(order)
            self.acc = self.gather_scores(self.acc, order)
        acc = self.acc
        index = self.select(acc, hk)
        self._keep_padded(index)
        self.acc = self.gather_scores(acc, index)

    def _metadata_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.acc,)
