"""Quest's decode in fixed shapes: page bounds updated in place, the top pages recalled on the device.

The reference (:class:`~ov_kvcrush.methods.quest.QuestLayerCache`) concatenates its store and
recomputes the last page's bounds every step, and its page count grows with the sequence. Here the
store and the per-page channel-wise max/min keys are preallocated for the store's capacity: a step
writes its token at the device count ``n_dev``, folds it into its page's bounds, scores every page
(pages not reached yet score ``-inf``, the current one ``+inf``, as in the reference), takes the
top ``budget // page_size`` with the reference's tie order, and attends their tokens (those not
written yet masked). The same pages and tokens as the reference (tested), in shapes that change
only when the store grows, so the engine replays the step as a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

from ov_kvcrush.fastpath.dense import FastLayerCache
from ov_kvcrush.methods.base import gather_tokens, tensor_bytes, topk_indices
from ov_kvcrush.methods.quest import QuestConfig, page_bounds, page_upper_bounds, quest_select


class FastQuestLayerCache(FastLayerCache):
    """One layer of Quest for the fast path (see the module doc)."""

    def __init__(self, config: QuestConfig, dense: bool = False, reserve: int = 0) -> None:
        super().__init__(reserve)
        assert config.budget is not None
        self.config = config
        self.dense_layer = dense
        self.pages = config.budget // config.page_size  # pages recalled per step
        self.kmax: torch.Tensor | None = None  # [b, hk, capacity pages, d] float32
        self.kmin: torch.Tensor | None = None
        self.last_selected: torch.Tensor | None = None  # [b, hk, pages * page_size] (-1: not written yet)

    def _after_prefill(self) -> None:
        if not self.dense_layer:
            self._bounds()

    def _bounds(self) -> None:
        """The page bounds for the store's capacity, from the tokens held (unreached pages: empty)."""
        ps = self.config.page_size
        k, _ = self.buffer.view()
        b, hk, _, d = k.shape
        total = -(-self.buffer.capacity // ps)
        self.kmax = torch.full((b, hk, total, d), float("-inf"), device=k.device)
        self.kmin = torch.full((b, hk, total, d), float("inf"), device=k.device)
        hi, lo = page_bounds(k, ps)
        self.kmax[:, :, : hi.shape[2]] = hi
        self.kmin[:, :, : lo.shape[2]] = lo

    def before_step(self, t: int) -> None:
        capacity = self.buffer.capacity
        super().before_step(t)
        if not self.dense_layer and self.buffer.capacity != capacity:
            self._bounds()  # the store moved and grew: bounds for its new pages

    def graph_key(self) -> tuple[Any, ...] | None:
        return (self.buffer.capacity,)

    def step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.dense_layer:
            return super().step(queries, keys, values)
        assert self.n_dev is not None and self.kmax is not None and self.kmin is not None
        ps = self.config.page_size
        page = torch.div(self.n_dev, ps, rounding_mode="floor")  # the new token's page, [1]
        new = keys.float()
        self.kmax.index_copy_(2, page, torch.maximum(self.kmax.index_select(2, page), new))
        self.kmin.index_copy_(2, page, torch.minimum(self.kmin.index_select(2, page), new))
        self._write(keys, values)
        k, v = self.buffer.keys, self.buffer.values
        assert k is not None and v is not None
        bound = page_upper_bounds(queries, self.kmax, self.kmin)  # [b, hk, P]; unreached pages masked below
        index = torch.arange(bound.shape[2], device=k.device)
        bound = torch.where(index > page, float("-inf"), torch.where(index == page, float("inf"), bound))
        top = topk_indices(bound, min(self.pages, bound.shape[2]))
        slots = (top.unsqueeze(-1) * ps + torch.arange(ps, device=k.device)).flatten(2)
        slots = slots.clamp_max(k.shape[2] - 1)
        self.last_selected = torch.where(slots < self.n_dev, slots, -1)
        return self._attend_store(queries, self.last_selected)

    def _multi_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Several tokens (eager): the reference's selection over everything held, causally."""

        if self.dense_layer:
            return super()._multi_step(queries, keys, values)
        t = keys.shape[2]
        k, v = self._write_each(keys, values)
        self._bounds_from(k)
        assert self.config.budget is not None
        slots = quest_select(queries, k, self.config.page_size, self.config.budget)
        self.last_selected = slots
        pos = torch.arange(self.seen, self.seen + t, device=k.device)
        return self._attend(
            queries, gather_tokens(k, slots), gather_tokens(v, slots), q_positions=pos, k_positions=slots
        ).output

    def _bounds_from(self, k: torch.Tensor) -> None:
        assert self.kmax is not None and self.kmin is not None
        hi, lo = page_bounds(k, self.config.page_size)
        self.kmax[:, :, : hi.shape[2]] = hi
        self.kmin[:, :, : lo.shape[2]] = lo

    def tokens_attended(self) -> torch.Tensor:
        if self.last_selected is None:
            return self.tokens_held()
        return (self.last_selected >= 0).sum(-1)

    def _metadata(self) -> list[torch.Tensor | None]:
        return [*super()._metadata(), self.kmax, self.kmin, self.last_selected]

    def decode_read_bytes(self) -> int:
        """Every page's bounds (scored each step), and the recalled pages' tokens."""
        if self.dense_layer or self.kmax is None or self.kmin is None:
            return super().decode_read_bytes()
        pages = min(self.pages, self.kmax.shape[2])
        return tensor_bytes(self.kmax, self.kmin) + pages * self.config.page_size * self.token_bytes()

    def memory(self) -> dict[str, int]:
        kv = self.buffer.nbytes()
        meta = tensor_bytes(*self._metadata())
        return {"kv": kv, "metadata": meta, "total": kv + meta}
