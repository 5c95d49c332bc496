"""KVCrush's layer cache over the GPU path's device pool: SnapKV's scores
(:class:`~ov_kvcrush.gpu.importance_cache.DeviceSnapKVLayerCache`), and KVCrush's selection over them
on the device (:mod:`ov_kvcrush.gpu.kvcrush`), token by token or over whole blocks. Split from
:mod:`ov_kvcrush.gpu.layer_cache`, whose SnapKV cache it extends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ov_kvcrush.gpu.importance_cache import DeviceSnapKVLayerCache
from ov_kvcrush.gpu.kvcrush import KVCrushChoice, StepSelection, launch_select
from ov_kvcrush.gpu.slots import KeptSlots
from ov_kvcrush.gpu.step_work import StepWork
from ov_kvcrush.methods.kvcrush import KVCrushConfig
from ov_kvcrush.methods.selection import plan_spans


class DeviceKVCrushLayerCache(DeviceSnapKVLayerCache):
    """KVCrush over the device pool: SnapKV's scores, and KVCrush's selection over them on the
    device (``kvcrush.cl``: the important tokens, the heads' signatures, the anchors' distances,
    the buckets and their representatives), token by token or over whole blocks (``block_size``:
    the blocks' summed scores, the reference's plan of sink, recent and partial blocks); once per
    layer (``scope="layer"``: every KV head keeps the same tokens) or once per KV head over its
    query group's scores (``scope="head"``: the layer's fixed anchors cut to the group's bits)."""

    config: KVCrushConfig

    def _choice(self, budget: int, sinks: int, recent: int, representatives: int, heads: slice) -> KVCrushChoice:
        cfg = self.config
        bits = cfg.anchor_bits(self.layer.q_heads)
        width = heads.stop - heads.start
        anchors = np.array([[c == "1" for c in b[heads]] if b != "mean" else [False] * width for b in bits])
        return KVCrushChoice(budget, sinks, recent, representatives, anchors, tuple(b == "mean" for b in bits),
                             cfg.signature, cfg.multi_anchor, cfg.representative)  # fmt: skip

    def _drops_lowest(self) -> bool:
        return False  # KVCrush's selection: buckets and representatives, not the lowest score

    def _units(self, n: int) -> UnitPlan:
        """What a selection over ``n`` held slots takes: every token, or the whole blocks (the
        reference's plan of sink, recent and partial blocks, the counts in blocks)."""
        cfg = self.config
        reps = cfg.n_representatives
        if cfg.block_size is None:
            return UnitPlan(1, n, self.budget, cfg.sink_tokens, cfg.recent_tokens, reps)
        block = cfg.block_size
        plan = plan_spans(torch.zeros(1, 1, n), self.budget, cfg.sink_tokens, cfg.recent_tokens, block,
                          reserved=reps // block, what="sink, recent and representative blocks")  # fmt: skip
        return UnitPlan(block, plan.full, plan.budget, plan.sink, plan.recent, reps // block)

    def _rows(self) -> list[slice]:
        """The query heads of each selection: a KV head's group (``scope="head"``), or all."""
        lay = self.layer
        group = lay.q_heads // lay.kv_heads
        if self.config.scope == "head":
            return [slice(g * group, (g + 1) * group) for g in range(lay.kv_heads)]
        return [slice(0, lay.q_heads)]

    def _choices(self, plan: UnitPlan) -> list[KVCrushChoice]:
        """Each row's selection (:meth:`_rows`) in ``plan``'s units."""
        counts = (plan.budget, plan.sinks, plan.recent, plan.representatives)
        return [self._choice(*counts, heads) for heads in self._rows()]

    def _select_in_step(self, work: StepWork) -> None:
        """A decode step's selection anew that drops one unit (a token past the budget, or the
        block's worth come past it): launched with the step's other sequences' (``work``'s drop),
        not the sequence's own launches after them."""
        n = self.layer.held
        plan = self._units(n)
        selection = StepSelection.of(n, plan.block, plan.units, self._choices(plan))
        if selection is None:
            super()._select_in_step(work)
            return
        work.drop_selected(selection)
        self._bump("evicted", float(plan.block * self.layer.kv_heads))

    def _select(self, n: int, width: int) -> KeptSlots:
        """The selection of every row in one launch (``kvcrush_select``), at any size: a prompt's
        and a decode step's alike."""
        lay, plan, rows = self.layer, self._units(n), self._rows()
        sel = launch_select(lay.pool.dev, lay.pool, self.scores, self.stride, n, plan.block, plan.units,
                            self._choices(plan))  # fmt: skip
        k = sel.fields.kept
        return KeptSlots(sel.kept, k if len(rows) > 1 else 0, k)  # one row: every KV head reads its list


@dataclass(frozen=True)
class UnitPlan:
    """A selection's units (``block`` tokens each: 1, or the block-wise form's whole blocks) and
    its counts in units."""

    block: int
    units: int
    budget: int
    sinks: int
    recent: int
    representatives: int
