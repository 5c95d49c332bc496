"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv 2406.10774): the page-recall baseline beside ClusterKV.

Per page of ``page_size`` tokens, the channel-wise max and min keys are kept; each decode step
recalls the pages with the highest upper bound ``sum_c max(q_c * kmax_c, q_c * kmin_c)`` until
the budget, the page holding the newest token always included. Nothing is evicted.

Departures from the paper: the bounds are kept per KV head and the query's bound is summed over
the query heads of its group (grouped-query models, which Quest's kernels predate); the first
``dense_layers`` layers attend everything, as in the paper. Torch engine only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import ShapeError, check_query, group_heads
from ov_kvcrush.methods.base import LayerCache, MethodConfig, check_layer, tensor_bytes, topk_indices
from ov_kvcrush.methods.recall import RecallLayerCache, recall_rate, summarize_recall
from ov_kvcrush.methods.runtimes import RECALL_TRACKING, Declaration
from ov_kvcrush.validation import check_budget, check_int


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page metadata: channel-wise max and min of the keys of each page, ``[b, hk, pages, d]`` float32."""
    b, hk, n, d = keys.shape
    pages = -(-n // page_size)
    pad = pages * page_size - n
    kf = keys.float()
    kmax = F.pad(kf, (0, 0, 0, pad), value=float("-inf")).reshape(b, hk, pages, page_size, d).amax(3)
    kmin = F.pad(kf, (0, 0, 0, pad), value=float("inf")).reshape(b, hk, pages, page_size, d).amin(3)
    return kmax, kmin


def page_upper_bounds(queries: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """Each page's upper bound ``sum_c max(q_c * kmax_c, q_c * kmin_c)``, summed over the step's
    query tokens and a KV head's query group, ``[b, hk, pages]`` float32.

    ``kmax >= kmin`` channel by channel, so the max takes ``kmax`` where ``q_c >= 0`` and ``kmin``
    where ``q_c < 0``: the bound is two products, ``kmax . sum(q+) + kmin . sum(q-)`` over the
    group, with no ``[b, hk, group, pages, d]`` temporary (1 GB a layer for a batch of 8 at 32k).
    """
    b, hk, _, d = kmax.shape
    q = queries.float().sum(dim=2).reshape(b, hk, -1, d)  # summed over the step's query tokens
    above, below = q.clamp_min(0).sum(2), q.clamp_max(0).sum(2)  # [b, hk, d]
    return (kmax @ above.unsqueeze(-1) + kmin @ below.unsqueeze(-1)).squeeze(-1)


def quest_select(
    queries: torch.Tensor,
    keys: torch.Tensor,
    page_size: int,
    budget: int,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Quest: per KV head, the tokens of the top ``budget // page_size`` pages by their upper-bound score.

    The page holding the newest token is always one of them. Returns ``[b, hk, k]`` ascending
    token indices (``k = min(n, pages * page_size)`` minus the unfilled part of the last page).
    ``bounds`` are the pages' :func:`page_bounds` when the caller maintains them incrementally.
    """
    check_query(queries, keys)
    check_int("page_size", page_size, 1, 4096)
    n = keys.shape[2]
    pages = -(-n // page_size)
    want = min(budget // page_size, pages)
    if want == 0:
        raise ConfigError("budget", budget, f"at least page_size={page_size}")
    pad = pages * page_size - n
    kmax, kmin = page_bounds(keys, page_size) if bounds is None else bounds
    if kmax.shape[2] != pages:
        raise ShapeError(f"bounds cover {kmax.shape[2]} pages, the keys {pages}")
    bound = page_upper_bounds(queries, kmax, kmin)
    bound[..., -1] = float("inf")  # the current page
    top = topk_indices(bound, want)
    tok = (top.unsqueeze(-1) * page_size + torch.arange(page_size, device=keys.device)).flatten(2)
    if pad:  # the last (always selected, so last in ascending order) page is partial
        tok = tok[..., : tok.shape[-1] - pad].contiguous()  # a copy: callers keep it, not the padded one
    return tok


@dataclass(frozen=True)
class QuestConfig(MethodConfig):
    """Quest: recall fixed-size pages by per-channel max/min key bounds.

    Attributes:
        budget: tokens attended per decode step and KV head (whole pages). Required.
        page_size: tokens per page (16 in Quest).
        dense_layers: first layers left uncompressed (2 in Quest).
        track_recall: also compute, every step, the recall rate of the selected tokens against
            the true top-``budget`` tokens by attention (costs a full attention; for evaluation).
    """

    name: ClassVar[str] = "quest"
    departure: ClassVar[str] = "the paper's, bounds per KV head (GQA)"
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cuda": (RECALL_TRACKING,),
        "gpu-pool": (RECALL_TRACKING,),
        "gpu-plugin": (RECALL_TRACKING,),
    }
    budget: int | None = None
    page_size: int = 16
    dense_layers: int = 2
    track_recall: bool = False

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 1, 4096)
        check_budget("budget", self.budget, self.page_size, " for method quest (at least page_size)")
        check_int("dense_layers", self.dense_layers, 0, 4096)
        if not isinstance(self.track_recall, bool):
            raise ConfigError("track_recall", self.track_recall, "true or false")

    def layer_budget(self, layer_idx: int, num_layers: int) -> int | None:
        return None if layer_idx < self.dense_layers else self.budget

    def summarize_counters(self, total: dict[str, float]) -> dict[str, float]:
        return summarize_recall(total)

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        return QuestLayerCache(self, dense=layer_idx < self.dense_layers)


class QuestLayerCache(RecallLayerCache):
    """Quest state of one layer: full store plus per-page key bounds, updated as tokens arrive."""

    def __init__(self, config: QuestConfig, dense: bool = False) -> None:
        super().__init__(None, dense)
        self.config = config
        self.kmax: torch.Tensor | None = None  # [b, hk, pages, d] float32
        self.kmin: torch.Tensor | None = None

    def _after_prefill(self, keys: torch.Tensor) -> None:
        if not self.dense_layer:
            self.kmax, self.kmin = page_bounds(keys, self.config.page_size)

    def _select(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        assert self.config.budget is not None and self.kmax is not None and self.kmin is not None
        ps = self.config.page_size
        first = self.kmax.shape[2] - 1  # the last page may have been partial: recompute from it on
        hi, lo = page_bounds(keys[:, :, first * ps :], ps)
        self.kmax = torch.cat([self.kmax[:, :, :first], hi], dim=2)
        self.kmin = torch.cat([self.kmin[:, :, :first], lo], dim=2)
        slots = quest_select(queries, keys, ps, self.config.budget, bounds=(self.kmax, self.kmin))
        if self.config.track_recall:
            res = self._attend(queries, keys, keys, return_scores=True)
            assert res.scores is not None
            self._record_recall(recall_rate(slots, group_heads(res.scores, keys.shape[1]), self.config.budget))
        return slots

    def memory(self) -> dict[str, int]:
        m = self.store.memory()
        meta = m["metadata"] + tensor_bytes(self.kmax, self.kmin, self.last_selected)
        return {"kv": m["kv"], "metadata": meta, "total": m["kv"] + meta}
