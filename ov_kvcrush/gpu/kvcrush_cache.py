"""KVCrush's layer cache over the GPU path's device pool: SnapKV's scores
(:class:`~ov_kvcrush.gpu.layer_cache.DeviceSnapKVLayerCache`), and KVCrush's selection over them
on the device (:mod:`ov_kvcrush.gpu.kvcrush`), token by token or over whole blocks. Split from
:mod:`ov_kvcrush.gpu.layer_cache`, whose SnapKV cache it extends."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ov_kvcrush.gpu.kvcrush import KVCrushChoice, launch_block_sums, select_mask_on_device
from ov_kvcrush.gpu.layer_cache import DeviceSnapKVLayerCache
from ov_kvcrush.gpu.slots import KeptSlots
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

    def _select(self, n: int, width: int) -> KeptSlots:
        lay = self.layer
        dev, kv = lay.pool.dev, lay.kv_heads
        group = lay.q_heads // kv
        per_head = self.config.scope == "head"
        rows = [slice(g * group, (g + 1) * group) for g in range(kv)] if per_head else [slice(0, lay.q_heads)]
        masks = dev.empty(max(n, 1) * len(rows))  # [rows, n]: 1 for a kept token
        counts = set()
        for r, heads in enumerate(rows):
            count, mask = self._select_rows(n, heads)
            dev.copy_bytes(mask, masks, n, r * n)
            counts.add(count)
        (k,) = counts  # every row keeps as many (the budget's count)
        kept_b = dev.empty(4 * max(k, 1) * len(rows))  # a list per row; one row: every KV head reads it
        i32 = np.int32
        dev.run(self._kernel("kept_slots"), (len(rows),), None, masks, i32(n), i32(0), i32(0), i32(n), kept_b, i32(k))
        return KeptSlots(kept_b, k if per_head else 0, k)  # listed on the device alone: nothing comes back

    def _select_rows(self, n: int, heads: slice) -> tuple[int, Any]:
        """KVCrush over the scores of query heads ``heads``: how many tokens it keeps, and their
        device mask ``[n]``."""
        lay, cfg = self.layer, self.config
        dev, h = lay.pool.dev, heads.stop - heads.start
        reps = cfg.n_representatives
        if cfg.block_size is None:
            scores = dev.copy_rows(self.scores, self.stride, h, n, heads.start)  # [h, n] packed, on the device
            choice = self._choice(self.budget, cfg.sink_tokens, cfg.recent_tokens, reps, heads)
            sel = select_mask_on_device(dev, lay.pool, scores, h, n, choice)
            return sel.kept, sel.mask
        block = cfg.block_size
        plan = plan_spans(torch.zeros(1, 1, n), self.budget, cfg.sink_tokens, cfg.recent_tokens, block,
                          reserved=reps // block, what="sink, recent and representative blocks")  # fmt: skip
        whole = plan.full * block  # the whole blocks' scores, packed
        sums = launch_block_sums(dev, dev.copy_rows(self.scores, self.stride, h, whole, heads.start), h, whole, block)
        choice = self._choice(plan.budget, plan.sink, plan.recent, reps // block, heads)
        blocks = select_mask_on_device(dev, lay.pool, sums, h, plan.full, choice)
        mask = dev.empty(max(n, 1))
        i32 = np.int32
        dev.run(self._kernel("block_mask", "kvcrush.cl"), (n,), None, blocks.mask, i32(block), i32(whole),
                i32(n), mask)  # fmt: skip
        return blocks.kept * block + plan.partial, mask
