"""Quest's layer cache over the GPU path's device pool: every token held, each decode step
attending the tokens of the pages its query's upper bound ranks highest.

The steps are the reference's (:class:`~ov_kvcrush.methods.quest.QuestLayerCache`), on the
device (``quest.cl``): each page's channel-wise key bounds, computed after the prompt and, per
step, again from the last page on (it fills as tokens arrive); every page's bound for the step's
query; the top pages (``kvcrush.cl``'s ``head_decisions_topk``: ties to the earlier page, as the
reference's ``topk_indices``; the newest token's page always); the list of their slots, which
every KV head attends. What crosses per decode step beside the model's tensors: the count of
slots attended (the same for every head, known on the host).

In OpenVINO's GPU plugin (``device="GPU"``) the model's pages layer (``OvkcPages``) does a decode
step's work after its store: the bounds of the pages from the last one computed on, into the
pool's :class:`~ov_kvcrush.gpu.arena.IndexArena` (a run of words per layer, taken twice as large
before the step where the pages outgrow it, that step computing every page's bounds into it),
the ranking and the list of slots; the host keeps where the bounds lie and how many pages they
cover.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.kvcrush import top_mask
from ov_kvcrush.gpu.layer_inputs import PAGE_FIELDS
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.recall_cache import DeviceRecallLayerCache
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.gpu.store import store_constants
from ov_kvcrush.methods.quest import QuestConfig


class DeviceQuestLayerCache(DeviceRecallLayerCache):
    """Quest over the device pool."""

    config: QuestConfig

    def __init__(self, config: QuestConfig, pool: DevicePool, kv_heads: int, q_heads: int, dense: bool) -> None:
        super().__init__(config, pool, kv_heads, q_heads, dense)
        self.bounds: tuple[Any, Any] | None = None  # device kmax, kmin [kv, cap, D] float32
        self.cap = 0  # pages the bounds have room for
        self.pages = 0  # pages whose bounds are computed

    def _after_prefill(self) -> None:
        if not self.dense_layer:
            self._update_bounds()

    def _after_append(self) -> None:
        self._update_bounds()

    # ---- the steps
    def _kernel(self, name: str) -> Any:
        return self.layer.pool.dev.kernel("quest.cl", name, store_constants(self.layer.pool.shape))

    def _update_bounds(self) -> None:
        """The bounds of every page from the last one computed on (it may have been partial)."""
        lay, ps = self.layer, self.config.page_size
        dev, kv, d = lay.pool.dev, lay.kv_heads, lay.pool.shape.head_dim
        n = lay.held
        pages = -(-n // ps)
        if pages > self.cap:  # room for more pages: every page's bounds computed again there
            self.cap = max(pages, 2 * self.cap)
            self.bounds = (dev.empty(4 * kv * self.cap * d), dev.empty(4 * kv * self.cap * d))
            self.pages = 0
        first = max(self.pages - 1, 0)
        tables, stride = lay.device_tables()
        i32 = np.int32
        dev.run(self._kernel("page_bounds"), (d, pages - first, kv), None, lay.pool.buffer, tables, i32(stride),
                i32(ps), i32(first), i32(n), *self.bounds, i32(self.cap))  # fmt: skip
        self.pages = pages

    def _attend_recalled(self, q: np.ndarray) -> np.ndarray:
        """The query ``[Hq, D]`` over the tokens of its top pages: the output ``[Hq, D]``."""
        lay, cfg = self.layer, self.config
        pool, dev, kv, d = lay.pool, lay.pool.dev, lay.kv_heads, lay.pool.shape.head_dim
        assert cfg.budget is not None and self.bounds is not None
        ps, n, pages = cfg.page_size, lay.held, self.pages
        want = min(cfg.budget // ps, pages)
        q_b = pool.upload("queries", q.astype(np.float32))
        bound = dev.empty(4 * kv * pages)
        i32 = np.int32
        dev.run(self._kernel("page_scores"), (pages, kv), None, q_b, i32(lay.q_heads // kv), *self.bounds,
                i32(self.cap), i32(pages), bound)  # fmt: skip
        decisions = top_mask(dev, bound, kv, pages, 0, pages - 1, want - 1)  # the last page is always kept
        count = (want - 1) * ps + n - (pages - 1) * ps
        slots = dev.empty(4 * kv * count)
        dev.run(self._kernel("page_slots"), (kv,), None, decisions, i32(pages), i32(ps), i32(n), slots, i32(count))
        counts = np.full(kv, count, np.int32)
        bounds_read = 2 * 4 * kv * pages * d
        return lay.attend_slots(q_b, self._scale(d), (slots, count), pool.upload("slots attended", counts), counts,
                                bounds_read)  # fmt: skip

    def _metadata_bytes(self) -> int:
        """The pages' bounds."""
        return 2 * 4 * self.layer.kv_heads * self.pages * self.layer.pool.shape.head_dim

    # ---- a model that stores and attends itself (our layers in OpenVINO's GPU plugin)
    recall_layer = "OvkcPages"
    recall_fields = PAGE_FIELDS
    #: the bounds' run in the pool's arena, for the plugin's model: (first word, pages per head);
    #: kmax [kv, cap, D], then kmin
    bounds_run: tuple[int, int] | None = None

    def _pages_of(self, slots: int) -> int:
        return -(-slots // self.config.page_size)

    def _pages_after_step(self) -> int:
        """The pages of the slots held (after :meth:`reserve`: the step's among them)."""
        return self._pages_of(self.layer.held)

    def _bounds_words(self, cap: int) -> int:
        """The words of a bounds run with room for ``cap`` pages a KV head: kmax, then kmin."""
        return 2 * self.layer.kv_heads * cap * self.layer.pool.shape.head_dim

    def _before_model_step(self) -> None:
        """Room in the arena for the bounds of the pages after the step. Where the run grows, the
        step's pages layer computes every page's bounds again into the new one (from page 0: its
        keys read once a doubling of the pages) rather than a copy of the old run: no command of
        its own."""
        pages = self._pages_of(self.layer.held + 1)
        first, cap = self.bounds_run or (0, 0)
        if pages <= cap:
            return
        arena = self.layer.pool.index_arena()
        if self.bounds_run is not None:
            arena.give(first, self._bounds_words(cap))
        new_cap = max(pages, 2 * cap)
        self.bounds_run = (arena.take(self._bounds_words(new_cap)), new_cap)
        self.pages = 0

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """After a decode step: its pages' bounds were computed inside the model."""
        if not self.in_prompt and not self.dense_layer and self.bounds_run is not None:
            self.pages = self._pages_after_step()

    def truncate(self, tokens: int) -> bool:
        """As the full cache's; the bounds from the page of the first token dropped on are
        computed again."""
        if not super().truncate(tokens):
            return False
        self.pages = min(self.pages, tokens // self.config.page_size + 1)
        return True

    def release(self) -> None:
        if self.bounds_run is not None:
            first, cap = self.bounds_run
            self.layer.pool.index_arena().give(first, self._bounds_words(cap))
            self.bounds_run = None
        super().release()

    def _recall_fields(self, token: int) -> dict[str, Any]:
        assert self.bounds_run is not None and self.config.budget is not None
        kv, d, ps = self.layer.kv_heads, self.layer.pool.shape.head_dim, self.config.page_size
        first, cap = self.bounds_run
        pages = self._pages_after_step()
        heads = np.arange(kv)
        return dict(token=token, head=heads, pages=pages, kmax=first + heads * cap * d,
                    kmin=first + (kv + heads) * cap * d, first_page=max(self.pages - 1, 0),
                    want=min(self.config.budget // ps, pages), held=self.layer.held, page=ps)  # fmt: skip

    def _listed(self) -> int:
        assert self.config.budget is not None
        ps, n = self.config.page_size, self.layer.held
        pages = self._pages_after_step()
        return (min(self.config.budget // ps, pages) - 1) * ps + n - (pages - 1) * ps

    def candidates(self) -> int:
        return 0 if self.dense_layer else self._pages_after_step()

    def model_step_read(self) -> int:
        """The slots a decode row attends, and the pages' bounds its query ranks."""
        kv, d = self.layer.kv_heads, self.layer.pool.shape.head_dim
        bounds = 0 if self.dense_layer else 2 * 4 * kv * self._pages_after_step() * d
        return self._full_precision_read(self.attended()) + bounds
