"""What the recall methods share (ClusterKV, Quest): a full store, and per decode step attention
over a recalled subset of it, with the optional top-B recall accounting.

Nothing is evicted: a recall method bounds what each decode step *attends*, not what is held.
Subclasses choose the subset (:meth:`RecallLayerCache._select`).
"""

from __future__ import annotations

import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.base import LayerCache, QuantSettings, gather_tokens, topk_indices
from ov_kvcrush.methods.store import make_store


def recall_rate(selected: torch.Tensor, attention: torch.Tensor, budget: int) -> float:
    """ClusterKV's recall rate: ``|selected ∩ top-B(attention)| / B``, averaged over the leading dims.

    Args:
        selected: ``[..., k]`` token indices chosen by the method (``-1`` entries are ignored).
        attention: ``[..., n]`` the true attention weights over the same tokens.
        budget: ``B``; clipped to ``n``.
    """
    n = attention.shape[-1]
    b = min(budget, n)
    if b == 0:
        raise ConfigError("budget", budget, f"an integer in [1, {max(n, 1)}] (and at least one token)")
    true_top = topk_indices(attention.float(), b)
    sel = torch.zeros(*attention.shape, dtype=torch.bool, device=attention.device)
    valid = selected >= 0
    sel.scatter_(-1, selected.clamp_min(0), valid)
    hits = torch.gather(sel, -1, true_top).sum(-1).float()
    return float((hits / b).mean())


class RecallLayerCache(LayerCache):
    """Shared by ClusterKV and Quest: a full store; each decode step attends a recalled subset."""

    def __init__(self, quant: QuantSettings | None, dense: bool) -> None:
        super().__init__()
        self.store = make_store(quant)
        self.dense_layer = dense
        self.last_selected: torch.Tensor | None = None  # [b, hk, k] slots attended at the last step

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        out = self._attend(queries, keys, values, q_positions=pos, k_positions=pos).output
        self.store.append(keys, values, pos)
        self._after_prefill(keys)
        return out

    def _after_prefill(self, keys: torch.Tensor) -> None:
        pass

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._before_append(keys)
        pos = self._positions(keys.shape[2], keys.device)
        self.store.append(keys, values, pos)
        k, v, p = self.store.dense()
        if self.dense_layer:
            return self._attend(queries, k, v, q_positions=pos, k_positions=p).output
        slots = self._select(queries, k)  # [b, hk, s]
        self.last_selected = slots
        ks, vs = gather_tokens(k, slots), gather_tokens(v, slots)
        return self._attend(queries, ks, vs, q_positions=pos, k_positions=torch.gather(p, 2, slots)).output

    def _before_append(self, keys: torch.Tensor) -> None:
        pass

    def _select(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tokens_held(self) -> torch.Tensor:
        assert self.store.positions is not None
        return (self.store.positions >= 0).sum(-1)

    def _record_recall(self, rate: float) -> None:
        """Count one step's top-B recall rate; ``recall_rate`` is the mean over the steps so far."""
        self._bump("recall_sum", rate)
        self._bump("recall_steps")
        self.counters["recall_rate"] = self.counters["recall_sum"] / self.counters["recall_steps"]

    def tokens_attended(self) -> torch.Tensor:
        """``[b, hk]`` tokens the last decode step attended."""
        if self.last_selected is None:
            return self.tokens_held()
        return torch.full(self.last_selected.shape[:2], self.last_selected.shape[2])


def summarize_recall(total: dict[str, float]) -> dict[str, float]:
    """``recall_rate`` of counters summed over layers: the summed rates over the summed steps."""
    if "recall_steps" in total:
        total["recall_rate"] = total["recall_sum"] / total["recall_steps"] if total["recall_steps"] else 0.0
    return total
