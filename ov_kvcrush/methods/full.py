"""``full``: the uncompressed baseline, with the same per-layer interface as every method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ov_kvcrush.methods.base import LayerCache, MethodConfig, ShapeError, attend, check_kv, check_layer, check_query
from ov_kvcrush.methods.store import FPStore


@dataclass(frozen=True)
class FullConfig(MethodConfig):
    """Keep every token in full precision (no fields: nothing to tune)."""

    name: ClassVar[str] = "full"
    needs_budget: ClassVar[bool] = False

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        return FullLayerCache()


class FullLayerCache(LayerCache):
    """Concatenates keys/values and attends over all of them (causal within a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.store = FPStore()

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        check_kv(keys, values)
        check_query(queries, keys)
        if self.seen:
            raise RuntimeError("prefill called twice on the same layer cache; use decode for later tokens")
        if queries.shape[2] != keys.shape[2]:
            raise ShapeError(
                f"prefill needs one query per prompt token: {queries.shape[2]} queries, {keys.shape[2]} keys"
            )
        return self.decode(queries, keys, values)

    def decode(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        check_kv(keys, values)
        check_query(queries, keys)
        pos = self._positions(keys.shape[2], keys.device)
        self.store.append(keys, values, pos)
        k, v, p = self.store.dense()
        return attend(queries, k, v, q_positions=pos, k_positions=p).output

    def tokens_held(self) -> torch.Tensor:
        assert self.store.positions is not None
        return torch.full(self.store.positions.shape[:2], self.store.positions.shape[2])

    def memory(self) -> dict[str, int]:
        m = self.store.memory()
        return {"kv": m["kv"], "metadata": m["metadata"], "total": m["kv"] + m["metadata"]}
