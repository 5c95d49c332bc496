"""Chelsea (seed 002): chunked soft matching and degree-weighted merging of keys and values.

When a layer holds ``budget + merge_interval`` tokens (``s >= B + g`` in the paper's Algorithm 1)
it is compressed back to ``budget``: the ``sink_tokens`` first and ``recent_tokens`` last tokens
stay as they are; the tokens between are cut into chunks of ``chunk_size``; inside each chunk,
tokens alternate between set A (even offsets) and set B (odd offsets), the partition the paper
proves optimal when similarity decays with distance; each A token is linked to its most similar
B token of the chunk (cosine of keys, ties to the earlier B). All links of all chunks are ranked
and only the strongest ``s - budget`` are kept (the weakest are pruned): each kept link merges its
A token into its B token. A B token with several A tokens forms one cluster. Because one pass
can at most halve the middle, passes repeat until the target is met.

Merging is degree-weighted: a token carries its degree ``n`` (how many original tokens it stands
for, 1 at first, summed on merges, tracked across repeated merges) and a cluster's key and value
are ``sum(n_i k_i) / sum(n_i)``. Attention adds ``log(n)`` to each held token's logit (the paper's
equation 2), which is exact when a cluster's members had identical keys and values.

Every KV head removes the same number of tokens, so a layer stays one dense tensor. Heads listed
in ``outlier_heads`` (found offline by :func:`calibrate_outlier_heads`, 4 % of heads in the paper)
are never merged and keep their full cache; they count against the budget, so the other heads
merge down to :func:`merged_budget` (what ``budget x`` the method's heads leaves after the
outliers' tokens). ``outlier_heads="auto"`` has an engine run the calibration on the model once
(``ov_kvcrush.engines.calibration``: 2048 tokens of essay prose, cached per model).

Paper: Hu et al., "Efficient Long-Context LLM Inference via KV Cache Clustering" (Chelsea),
arXiv 2506.11418 (seed 002).

Where this departs from it:

* By default each pass merges every usable link up to the target. ``merge_ratio``,
  ``ratio_decay`` and ``decay_steps`` give the paper's schedule ``r = r_init - alpha * min(m, i)``
  (Appendix C.2: 0.35, 0.1, 2 for Llama-3; a constant 0.25 for its needle test): pass ``i`` of a
  compression merges at most ``floor(r * middle)`` links, at least one.
* ``link_score="key_value"`` (not the paper's; off by default) ranks links by the lower of their
  keys' and values' cosine.
* The engines calibrate outlier heads by default (``"auto"``), as the paper does, but on the
  evaluation corpus's first essays instead of the paper's data; a config built directly (the
  reference without a model) has none unless given.
* Decode-time merging runs every ``merge_interval`` tokens per layer, as the paper's ``g``.
* ``protect_tokens`` (not the paper's; by default three quarters of the budget, 768 at 1024)
  keeps, per KV head, that many middle tokens out of merging: those the prompt's last 32 queries
  attend most (SnapKV's window scores, pooled over 31 tokens). Merging blends a needle's digits
  into their neighbours (their keys are alike); the window's scores say which exact tokens the
  prompt asks about. The others merge as the paper says, over their own sequence (a protected
  token is skipped, not a barrier), into the budget left. A merged slot keeps its B token's
  score; tokens after the prompt score 0. On 6 unfamiliar 3k-token needle prompts at budget
  1024 our op answers 5 with it, as many as the full cache, and none with the paper's merge
  (``ov-kvcrush eval --backend openvino --tasks niah_single --lengths 3072 --samples 6 --methods
  full,chelsea,chelsea:preset=paper --budgets 1024``). ``preset=paper`` (``protect_tokens=0``)
  is the paper's form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import ShapeError, group_heads
from ov_kvcrush.methods.base import LayerCache, MethodConfig, QuantSettings, check_layer, tensor_bytes, topk_indices
from ov_kvcrush.methods.importance import DEFAULT_POOL_KERNEL
from ov_kvcrush.methods.runtimes import TWO_BIT_STORE, Declaration
from ov_kvcrush.methods.selection import snapkv_scores
from ov_kvcrush.methods.store import FPStore, make_store
from ov_kvcrush.validation import check_budget, check_choice, check_float, check_int

# --------------------------------------------------------------------------------------------
# algorithm


@dataclass
class Links:
    """Chunked soft matching links of one token range, per head (``[B, E]`` each, E = A tokens).

    ``a`` and ``b`` index tokens in the range, ``similarity`` is the cosine of their keys
    (``-inf`` for an A token whose chunk has no B token).
    """

    a: torch.Tensor
    b: torch.Tensor
    similarity: torch.Tensor


def chunked_soft_matching(keys: torch.Tensor, chunk_size: int, values: torch.Tensor | None = None) -> Links:
    """Link every A token (even offset in its chunk) to its most similar B token (odd offset) of the same chunk.

    ``keys`` ``[B, n, d]``; chunks are ``[j * chunk_size, (j + 1) * chunk_size)``, the last one
    possibly shorter. With ``values``, a link's strength is the lower of its keys' and its values'
    cosine (the B token is still the most key-similar): tokens that look alike to the queries
    but carry different content (a needle's digits) are merged last.
    """
    if keys.dim() != 3:
        raise ShapeError(f"chunked_soft_matching needs [B, n, d] keys, got {tuple(keys.shape)}")
    check_int("chunk_size", chunk_size, 2, 1 << 16)
    if chunk_size % 2:
        raise ConfigError("chunk_size", chunk_size, "an even integer in [2, 65536]")
    bsz, n, d = keys.shape
    chunks = -(-n // chunk_size)
    pad = chunks * chunk_size - n
    kn = F.pad(F.normalize(keys.float(), dim=-1), (0, 0, 0, pad)).reshape(bsz, chunks, chunk_size, d)
    a, b = kn[:, :, 0::2], kn[:, :, 1::2]  # [B, chunks, c/2, d]
    sim = torch.matmul(a, b.transpose(-1, -2))  # [B, chunks, c/2, c/2]
    half = chunk_size // 2
    base = torch.arange(chunks, device=keys.device).view(chunks, 1) * chunk_size
    b_pos = base + 2 * torch.arange(half, device=keys.device) + 1  # [chunks, half]
    a_pos = base + 2 * torch.arange(half, device=keys.device)
    sim = sim.masked_fill((b_pos >= n).view(1, chunks, 1, half), float("-inf"))
    best_sim, best = sim.max(dim=-1)  # first max on ties
    b_idx = torch.gather(b_pos.expand(bsz, chunks, half), 2, best)
    a_idx = a_pos.expand(bsz, chunks, half)
    valid_a = (a_pos < n).view(1, chunks, half).expand(bsz, chunks, half)
    if values is not None:
        vn = F.pad(F.normalize(values.float(), dim=-1), (0, 0, 0, pad))  # [B, chunks * c, d]
        va = torch.gather(vn, 1, a_idx.reshape(bsz, -1, 1).expand(-1, -1, d))
        vb = torch.gather(vn, 1, b_idx.reshape(bsz, -1, 1).expand(-1, -1, d))
        best_sim = torch.minimum(best_sim, (va * vb).sum(-1).reshape(bsz, chunks, half))
    best_sim = best_sim.masked_fill(~valid_a, float("-inf"))
    keep = valid_a.reshape(bsz, -1)[0]  # A slots past the end are dropped (same for every head)
    return Links(a_idx.reshape(bsz, -1)[:, keep], b_idx.reshape(bsz, -1)[:, keep], best_sim.reshape(bsz, -1)[:, keep])


def usable_links(links: Links) -> int:
    """Links that can merge (their chunk has a B token); the same for every head."""
    return int(torch.isfinite(links.similarity[0]).sum()) if links.similarity.numel() else 0


def merge_links(
    keys: torch.Tensor, values: torch.Tensor, degrees: torch.Tensor, links: Links, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge along the ``count`` strongest links (ties to the earlier link) of every head.

    ``keys``/``values`` ``[B, n, d]``, ``degrees`` ``[B, n]``. Returns the merged
    ``(keys, values, degrees, kept)`` with ``n - count`` tokens in their original order, ``kept``
    ``[B, n - count]`` the surviving indices (each merged cluster survives as its B token).
    """
    bsz, n, d = keys.shape
    if not 0 <= count <= usable_links(links):
        raise ShapeError(f"cannot merge {count} links: only {usable_links(links)} usable")
    chosen = topk_indices(links.similarity, count)  # [B, count]
    a = torch.gather(links.a, 1, chosen)
    b = torch.gather(links.b, 1, chosen)
    w = degrees.float()
    wa = torch.gather(w, 1, a)
    num_k = keys.float() * w.unsqueeze(-1)
    num_v = values.float() * w.unsqueeze(-1)
    num_k = num_k.scatter_add(
        1, b.unsqueeze(-1).expand(bsz, count, d), torch.gather(num_k, 1, a.unsqueeze(-1).expand(bsz, count, d))
    )
    num_v = num_v.scatter_add(
        1, b.unsqueeze(-1).expand(bsz, count, d), torch.gather(num_v, 1, a.unsqueeze(-1).expand(bsz, count, d))
    )
    new_w = w.scatter_add(1, b, wa)
    alive = torch.ones(bsz, n, dtype=torch.bool, device=keys.device).scatter(1, a, False)
    kept = torch.nonzero(alive)[:, 1].reshape(bsz, n - count)
    gk = kept.unsqueeze(-1).expand(bsz, n - count, d)
    out_w = torch.gather(new_w, 1, kept)
    out_k = (torch.gather(num_k, 1, gk) / out_w.unsqueeze(-1)).to(keys.dtype)
    out_v = (torch.gather(num_v, 1, gk) / out_w.unsqueeze(-1)).to(values.dtype)
    return out_k, out_v, out_w.to(degrees.dtype), kept


def pass_cap(middle: int, passes: int, ratio_e4: int, decay_e4: int, decay_steps: int) -> int:
    """Links one matching pass may merge under the paper's schedule ``r = r_init - alpha * min(m, i)``
    (``ratio_e4`` = r_init and ``decay_e4`` = alpha in units of 1/10000, so the op computes the
    same integers): ``floor(r * middle)``, at least 1 (the paper keeps r above 0). ``ratio_e4`` 0:
    no cap (every usable link, up to the target)."""
    if not ratio_e4:
        return middle
    return max(1, (ratio_e4 - decay_e4 * min(decay_steps, passes)) * middle // 10000)


def chelsea_compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    degrees: torch.Tensor,
    target: int,
    sink_tokens: int,
    recent_tokens: int,
    chunk_size: int,
    schedule: tuple[int, int, int] = (0, 0, 0),
    value_aware: bool = False,
    scores: torch.Tensor | None = None,
    protect: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Merge ``[B, n, d]`` tokens down to ``target`` with repeated chunked soft matching of the middle range.

    With ``protect`` and ``scores`` ``[B, n]``, each row's ``protect`` highest-scoring middle
    tokens (ties to the earlier) are kept as they are, at most ``target - sink_tokens -
    recent_tokens - 1`` (one middle slot is left to merge into): the other tokens, in order, are
    merged down to ``target`` minus the protected ones, then both are put back in position order.

    ``schedule``: ``(ratio_e4, decay_e4, decay_steps)`` of :func:`pass_cap` (zeros: every usable
    link per pass). ``value_aware``: links ranked by the lower of key and value cosine. Returns
    ``(keys, values, degrees, kept, passes)``; ``kept`` ``[B, target]`` are the surviving original
    indices. ``target`` must leave at least one middle token.
    """
    bsz, n = keys.shape[:2]
    if n <= target:
        return keys, values, degrees, torch.arange(n, device=keys.device).expand(bsz, n), 0
    if target < sink_tokens + recent_tokens + 1:
        raise ConfigError(
            "budget", target, f"at least sink_tokens + recent_tokens + 1 = {sink_tokens + recent_tokens + 1}"
        )
    p = min(protect, target - sink_tokens - recent_tokens - 1, n - sink_tokens - recent_tokens)
    if scores is not None and p > 0:
        d = keys.shape[2]
        top = topk_indices(scores[:, sink_tokens : n - recent_tokens].float(), p) + sink_tokens  # ascending
        free = torch.ones(bsz, n, dtype=torch.bool, device=keys.device).scatter(1, top, False)
        rest = torch.nonzero(free)[:, 1].reshape(bsz, n - p)

        def rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return torch.gather(x, 1, index.unsqueeze(-1).expand(*index.shape, d))

        mk, mv, mw, mkept, passes = chelsea_compress(
            rows(keys, rest),
            rows(values, rest),
            torch.gather(degrees, 1, rest),
            target - p,
            sink_tokens,
            recent_tokens,
            chunk_size,
            schedule,
            value_aware,
        )
        kept = torch.cat([torch.gather(rest, 1, mkept), top], dim=1)
        order = torch.argsort(kept, dim=1)
        out_k = rows(torch.cat([mk, rows(keys, top)], dim=1), order)
        out_v = rows(torch.cat([mv, rows(values, top)], dim=1), order)
        out_w = torch.gather(torch.cat([mw, torch.gather(degrees, 1, top)], dim=1), 1, order)
        return out_k, out_v, out_w, torch.gather(kept, 1, order), passes
    kept = torch.arange(n, device=keys.device).expand(bsz, n)
    passes = 0
    while keys.shape[1] > target:
        s = keys.shape[1]
        lo, hi = sink_tokens, s - recent_tokens
        links = chunked_soft_matching(keys[:, lo:hi], chunk_size, values[:, lo:hi] if value_aware else None)
        count = min(s - target, usable_links(links), pass_cap(hi - lo, passes, *schedule))
        mk, mv, mw, mkept = merge_links(keys[:, lo:hi], values[:, lo:hi], degrees[:, lo:hi], links, count)
        keys = torch.cat([keys[:, :lo], mk, keys[:, hi:]], dim=1)
        values = torch.cat([values[:, :lo], mv, values[:, hi:]], dim=1)
        degrees = torch.cat([degrees[:, :lo], mw, degrees[:, hi:]], dim=1)
        kept = torch.cat([kept[:, :lo], torch.gather(kept[:, lo:hi], 1, mkept), kept[:, hi:]], dim=1)
        passes += 1
    return keys, values, degrees, kept, passes


#: ``outlier_heads`` value an engine resolves by calibrating on the model
OUTLIERS_AUTO = "auto"
#: what scores tokens for ``protect_tokens``: SnapKV's observation window and our default pooling
PROTECT_WINDOW = 32
PROTECT_POOL_KERNEL = DEFAULT_POOL_KERNEL
#: the share of the budget ``protect_tokens`` keeps out of merging by default
DEFAULT_PROTECT_SHARE = 0.75


#: the share of heads the calibration keeps whole (the paper's 4 %)
OUTLIER_RATIO = 0.04


def calibrate_outlier_heads(
    layer_keys: list[torch.Tensor], *, chunk_size: int = 256, threshold: float = 0.8, ratio: float = OUTLIER_RATIO
) -> tuple[tuple[int, int], ...]:
    """Find the heads that merge badly (the paper's offline calibration, Appendix B).

    For each layer's keys ``[b, kv_heads, n, d]``, a head's outlier score is the share of its A
    tokens whose best link has cosine below ``threshold``; the ``round(ratio * heads)`` highest
    scores over all layers and heads are returned as ``(layer, head)`` pairs.
    """
    check_float("threshold", threshold, -1.0, 1.0)
    check_float("ratio", ratio, 0.0, 1.0)
    scores = []
    for layer, k in enumerate(layer_keys):
        b, h, n, d = k.shape
        links = chunked_soft_matching(k.reshape(b * h, n, d), chunk_size)
        ok = torch.isfinite(links.similarity)
        weak = ((links.similarity < threshold) & ok).float().sum(-1) / ok.float().sum(-1).clamp_min(1)
        for head, v in enumerate(weak.reshape(b, h).mean(0).tolist()):
            scores.append((v, layer, head))
    count = int(ratio * len(scores) + 0.5)
    scores.sort(key=lambda x: (-x[0], x[1], x[2]))
    return tuple(sorted((layer, head) for _, layer, head in scores[:count]))


def merged_budget(budget: int, seen: int, heads: int, outliers: int, floor: int) -> int:
    """Tokens each merged head keeps when ``outliers`` of the method's ``heads`` heads (its layers x
    KV heads) hold all ``seen`` tokens whole.

    The paper counts outlier heads against the cache's budget: the others share what the whole
    budget (``budget x heads``) leaves after the outliers' tokens, so a cache with outlier heads
    holds what one without them holds. Never below ``floor`` (sinks + recent + 1: past
    ``budget x heads / outliers`` tokens the outliers alone outgrow the budget); ``budget`` when
    no head is an outlier.
    """
    if not outliers or outliers >= heads:
        return budget
    return max(floor, (budget * heads - outliers * seen) // (heads - outliers))


# --------------------------------------------------------------------------------------------
# config and layer cache


@dataclass(frozen=True)
class ChelseaConfig(MethodConfig):
    """Chelsea: merge similar tokens chunk by chunk, attend with ``log(degree)``.

    Attributes:
        budget: tokens (merged or not) held per layer and KV head after a compression. Required.
        sink_tokens: first tokens never merged (16 in the paper).
        recent_tokens: last tokens never merged (64 in the paper).
        chunk_size: tokens per matching chunk, even (256 in the paper).
        merge_interval: ``g``: compress when the layer reaches ``budget + g`` tokens, so merging
            runs every ``g`` decode steps rather than every step.
        outlier_heads: ``(layer, kv_head)`` pairs kept uncompressed; ``layer`` counts the layers
            the method runs on (on a model with sliding-window layers, the global ones), in both
            engines. They count against the budget (:func:`merged_budget`): the other heads keep
            fewer tokens as the outliers grow. ``"auto"``: the engine runs the paper's calibration
            (:func:`calibrate_outlier_heads`, 4 % of the heads) on the model once and caches it.
            ``"auto"`` is the default through :class:`~ov_kvcrush.config.CompressionConfig` (every
            engine, the CLI, eval, bench: :attr:`engine_defaults`); a config built directly has
            none (``()``), so the reference runs without a model.
        merge_ratio: the paper's ``r_init``, the share of the middle one matching pass may merge
            (``None``: every usable link, up to the target), in (0, 0.5].
        ratio_decay: the paper's ``alpha``: ``r`` falls by this much per pass, for ``decay_steps``
            passes (``m``).
        link_score: ``key`` (the paper: key cosine) or ``key_value`` (beyond the paper: the lower
            of key and value cosine, so tokens with alike keys and different values merge last).
        quant: hold the (merged) tokens in MiniKV's 2-bit format; merged tokens are re-quantized.
        protect_tokens: beyond the paper: per KV head, this many middle tokens that the prompt's
            last 32 queries attend most (pooled over 31 tokens) are never merged; they count
            against the budget (at most ``budget - sink_tokens - recent_tokens - 1``). ``None``
            (the default): three quarters of the budget (:attr:`protected_tokens`); 0: the
            paper's merge, which ``preset=paper`` gives.
    """

    name: ClassVar[str] = "chelsea"
    departure: ClassVar[str] = (
        "keeps 3/4 of the budget out of merging, the window's favourites (`preset=paper`: the paper's merge)"
    )
    #: our op and our GPU plugin layers do not run its merges over the 2-bit store (they re-encode it)
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cpu-op": (TWO_BIT_STORE,),
        "gpu-plugin": (TWO_BIT_STORE,),
    }
    pins_prompt_tail: ClassVar[bool] = False
    #: the engines calibrate outlier heads on the model unless told otherwise (the paper's
    #: Chelsea keeps 4 % of heads whole); a config built directly has none
    engine_defaults: ClassVar[dict[str, Any]] = {"outlier_heads": OUTLIERS_AUTO}
    #: ``chelsea:preset=paper``: the paper's merge, no token kept out of it
    presets: ClassVar[dict[str, dict[str, Any]]] = {"paper": {"protect_tokens": 0}}
    budget: int | None = None
    sink_tokens: int = 16
    recent_tokens: int = 64
    chunk_size: int = 256
    merge_interval: int = 32
    outlier_heads: tuple[tuple[int, int], ...] | str = ()
    quant: QuantSettings | None = None
    merge_ratio: float | None = None
    ratio_decay: float = 0.0
    decay_steps: int = 0
    link_score: str = "key"
    protect_tokens: int | None = None

    def store_settings(self) -> QuantSettings | None:
        return self.quant

    def __post_init__(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("recent_tokens", self.recent_tokens, 0)
        floor = self.sink_tokens + self.recent_tokens + 1
        check_budget("budget", self.budget, floor, " for method chelsea (sink_tokens + recent_tokens + 1)")
        check_int("chunk_size", self.chunk_size, 2, 1 << 16)
        if self.chunk_size % 2:
            raise ConfigError("chunk_size", self.chunk_size, "an even integer in [2, 65536]")
        check_int("merge_interval", self.merge_interval, 1, 1 << 16)
        if self.merge_ratio is not None:
            check_float("merge_ratio", self.merge_ratio, 1e-4, 0.5)
        check_float("ratio_decay", self.ratio_decay, 0.0, 0.5)
        check_int("decay_steps", self.decay_steps, 0, 1 << 10)
        check_choice("link_score", self.link_score, ("key", "key_value"))
        if self.protect_tokens is not None:
            check_int("protect_tokens", self.protect_tokens, 0, 1 << 20)
        pairs = () if self.outlier_heads == OUTLIERS_AUTO else self.outlier_heads
        if isinstance(pairs, str):
            raise ConfigError("outlier_heads", pairs, f"'{OUTLIERS_AUTO}' or a tuple of (layer, kv_head) pairs")
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, int) and x >= 0 for x in pair)):
                raise ConfigError(
                    "outlier_heads", self.outlier_heads, "a tuple of (layer, kv_head) pairs of integers >= 0"
                )
        if self.quant is not None and not isinstance(self.quant, QuantSettings):
            raise ConfigError("quant", self.quant, "a QuantSettings or None")
        if self.quant is not None:
            self.quant.pinned_tail(selecting=self.pins_prompt_tail)

    @property
    def protected_tokens(self) -> int:
        """Middle tokens kept out of merging per KV head: ``protect_tokens``, or by default
        :data:`DEFAULT_PROTECT_SHARE` of the budget (768 at 1024); a compression keeps at most
        what its budget leaves after the sinks, the recent tokens and one merged token."""
        if self.protect_tokens is not None:
            return self.protect_tokens
        assert self.budget is not None
        return int(self.budget * DEFAULT_PROTECT_SHARE)

    @property
    def needs_calibration(self) -> bool:
        return self.outlier_heads == OUTLIERS_AUTO

    def calibrate(self, layer_keys: list[torch.Tensor]) -> dict[str, Any]:
        """``outlier_heads="auto"``: the paper's calibration over ``layer_keys``."""
        pairs = calibrate_outlier_heads(layer_keys, chunk_size=self.chunk_size)
        return {"outlier_heads": [list(p) for p in pairs]}

    def with_calibration(self, fields: dict[str, Any]) -> ChelseaConfig:
        if not self.needs_calibration:
            return self
        try:
            pairs = tuple((int(layer), int(head)) for layer, head in fields["outlier_heads"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError("outlier_heads", fields, "a calibration's list of [layer, kv_head] pairs") from None
        return replace(self, outlier_heads=pairs)

    def calibration_key(self) -> str:
        return f"{self.name}-outliers-chunk{self.chunk_size}"

    def model_free(self) -> ChelseaConfig:
        """No outliers for ``"auto"``: which heads they are needs the model, and checking the
        other options (the op's fields) does not."""
        return replace(self, outlier_heads=()) if self.needs_calibration else self

    def _pairs(self) -> tuple[tuple[int, int], ...]:
        """The outlier pairs; ``"auto"`` must have been calibrated by an engine first."""
        if isinstance(self.outlier_heads, str):
            raise ConfigError(
                "outlier_heads",
                self.outlier_heads,
                "(layer, kv_head) pairs here: 'auto' is resolved by a calibration on the model before layers "
                "are made (the engines do it; with plain transformers, "
                "ov_kvcrush.engines.calibration.calibrate_hf(method, model, tokenizer); () for none)",
            )
        return self.outlier_heads

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        ratio, decay, steps = self.schedule()
        return {"sinks": self.sink_tokens, "recent": self.recent_tokens, "chunk": self.chunk_size,
                "merge_interval": self.merge_interval,
                "outliers": ",".join(f"{layer},{head}" for layer, head in self._pairs()), "ratio_e4": ratio,
                "decay_e4": decay, "decay_steps": steps, "link_score": self.link_score,
                "protect": self.protected_tokens}  # fmt: skip

    def schedule(self) -> tuple[int, int, int]:
        """``(ratio_e4, decay_e4, decay_steps)``: the merge-ratio schedule in 1/10000 units (see :func:`pass_cap`)."""
        if self.merge_ratio is None:
            return 0, 0, 0
        return round(self.merge_ratio * 10000), round(self.ratio_decay * 10000), self.decay_steps

    def layer_outliers(self, layer_idx: int) -> tuple[int, ...]:
        """The KV heads of method layer ``layer_idx`` kept whole (its outlier pairs' heads)."""
        return tuple(sorted(h for (layer, h) in self._pairs() if layer == layer_idx))

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        return ChelseaLayerCache(self, outlier_heads=self.layer_outliers(layer_idx), num_layers=num_layers)

    def merged_budget(self, seen: int, heads: int) -> int:
        """What a merged head keeps after ``seen`` tokens, of ``heads`` heads (:func:`merged_budget`)."""
        assert self.budget is not None
        floor = self.sink_tokens + self.recent_tokens + 1
        return merged_budget(self.budget, seen, heads, len(self._pairs()), floor)


class ChelseaLayerCache(LayerCache):
    """Chelsea state of one layer: merged tokens with degrees (compressed heads) and full outlier heads."""

    def __init__(self, config: ChelseaConfig, outlier_heads: tuple[int, ...] = (), num_layers: int = 1) -> None:
        super().__init__()
        self.config = config
        self.outlier_heads = outlier_heads
        self.num_layers = num_layers  # the method's layers: outlier heads count against all of theirs
        self.store = make_store(config.quant)
        self.full = FPStore()
        self.degrees: torch.Tensor | None = None  # [b, hc, s] float32
        self.protect_scores: torch.Tensor | None = None  # [b, hc, s]: protect_tokens's ranking
        self.merged_heads: list[int] = []

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, self.merged_heads], x[:, list(self.outlier_heads)]

    def _setup(self, kv_heads: int) -> None:
        bad = [h for h in self.outlier_heads if h >= kv_heads]
        if bad:
            raise ConfigError("outlier_heads", self.config.outlier_heads, f"kv_head indices below {kv_heads}")
        self.merged_heads = [h for h in range(kv_heads) if h not in self.outlier_heads]

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        self._setup(keys.shape[1])
        out = self._attend(queries, keys, values, q_positions=pos, k_positions=pos).output
        scores = None
        if self.config.protected_tokens:  # the window's attention, summed over each KV head's group
            window = snapkv_scores(queries, keys, PROTECT_WINDOW, PROTECT_POOL_KERNEL, "max", self.scale, self.softcap)
            scores = self._split(group_heads(window, keys.shape[1]))[0]
        self._append(keys, values, pos, scores)
        return out

    def _append(
        self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Hold new tokens (``scores``: their protect ranking, 0 without) and compress if due."""
        mk, fk = self._split(keys)
        mv, fv = self._split(values)
        b, t = keys.shape[0], keys.shape[2]
        ones = torch.ones(b, len(self.merged_heads), t, device=keys.device)
        self.degrees = ones if self.degrees is None else torch.cat([self.degrees, ones], dim=2)
        if self.config.protected_tokens:  # held only when used (memory() counts it)
            fresh = torch.zeros_like(ones) if scores is None else scores.float()
            held = self.protect_scores
            self.protect_scores = fresh if held is None else torch.cat([held, fresh], dim=2)
        if self.merged_heads:
            self.store.append(mk, mv, pos)
        if self.outlier_heads:
            self.full.append(fk, fv, pos)
        self._maybe_compress()

    def _maybe_compress(self) -> None:
        cfg = self.config
        assert cfg.budget is not None and self.degrees is not None
        s = self.degrees.shape[2]
        target = cfg.merged_budget(self.seen, self.num_layers * (len(self.merged_heads) + len(self.outlier_heads)))
        if not self.merged_heads or s < target + cfg.merge_interval:
            return
        k, v, p = self.store.dense()
        b, hc, n, d = k.shape
        protect = self.protect_scores
        ck, cv, cw, kept, passes = chelsea_compress(
            k.reshape(b * hc, n, d),
            v.reshape(b * hc, n, d),
            self.degrees.reshape(b * hc, n),
            target,
            cfg.sink_tokens,
            cfg.recent_tokens,
            cfg.chunk_size,
            cfg.schedule(),
            cfg.link_score == "key_value",
            scores=None if protect is None else protect.reshape(b * hc, n),
            protect=cfg.protected_tokens,
        )
        m = ck.shape[1]
        positions = torch.gather(p.reshape(b * hc, n), 1, kept).reshape(b, hc, m)
        self.store.replace(ck.reshape(b, hc, m, d), cv.reshape(b, hc, m, d), positions)
        self.degrees = cw.reshape(b, hc, m)
        if protect is not None:
            self.protect_scores = torch.gather(protect.reshape(b * hc, n), 1, kept).reshape(b, hc, m)
        self._bump("merges", (n - m) * b * hc)
        self._bump("compressions")
        self._bump("matching_passes", passes)

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._positions(keys.shape[2], keys.device)
        self._append(keys, values, pos)  # compresses first if the cache reached budget + g
        g = queries.shape[1] // keys.shape[1]
        out = torch.empty_like(queries)
        if self.merged_heads:
            k, v, p = self.store.dense()
            qh = [h * g + i for h in self.merged_heads for i in range(g)]
            assert self.degrees is not None
            res = self._attend(queries[:, qh], k, v, q_positions=pos, k_positions=p, bias=self.degrees.log())
            out[:, qh] = res.output
        if self.outlier_heads:
            k, v, p = self.full.dense()
            qh = [h * g + i for h in self.outlier_heads for i in range(g)]
            out[:, qh] = self._attend(queries[:, qh], k, v, q_positions=pos, k_positions=p).output
        return out

    def tokens_held(self) -> torch.Tensor:
        assert self.degrees is not None
        b = self.degrees.shape[0]
        hk = len(self.merged_heads) + len(self.outlier_heads)
        held = torch.zeros(b, hk, dtype=torch.long)
        held[:, self.merged_heads] = self.degrees.shape[2]
        if self.outlier_heads:
            held[:, list(self.outlier_heads)] = len(self.full)
        return held

    def memory(self) -> dict[str, int]:
        m = self.store.memory() if self.merged_heads else {"kv": 0, "metadata": 0}
        f = self.full.memory()
        kv = m["kv"] + f["kv"]
        meta = m["metadata"] + f["metadata"] + tensor_bytes(self.degrees)
        if self.config.protected_tokens:
            meta += tensor_bytes(self.protect_scores)
        return {"kv": kv, "metadata": meta, "total": kv + meta}
