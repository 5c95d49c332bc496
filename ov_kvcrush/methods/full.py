"""``full``: the uncompressed baseline, with the same per-layer interface as every method.

No paper: every token is kept in full precision (the reference every method is compared to).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ov_kvcrush.methods.base import LayerCache, MethodConfig, check_layer
from ov_kvcrush.methods.runtimes import Declaration
from ov_kvcrush.methods.store import FPStore


@dataclass(frozen=True)
class FullConfig(MethodConfig):
    """Keep every token in full precision (no fields: nothing to tune)."""

    name: ClassVar[str] = "full"
    #: every token is held and attended: a kept conversation loses nothing
    keeps_later_turns: ClassVar[bool] = True
    departure: ClassVar[str] = "no paper: nothing is compressed"
    needs_budget: ClassVar[bool] = False
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cuda": (),
        "cpu-op": (),
        "gpu-plugin": (),
        "gpu-pool": (),
        "genai": (),
    }

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        return {}

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        return FullLayerCache()


class FullLayerCache(LayerCache):
    """Concatenates keys/values and attends over all of them (causal within a step)."""

    #: sliding-window attention span (``None``: the whole past), see :class:`SlidingWindowLayerCache`
    window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.store = FPStore()

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        # the prompt over itself, with one position vector for every head: the cheapest mask
        out = self._attend(queries, keys, values, q_positions=pos, k_positions=pos, window=self.window).output
        self.store.append(keys, values, pos)
        self._trim()
        return out

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._positions(keys.shape[2], keys.device)
        self.store.append(keys, values, pos)
        k, v, p = self.store.dense()
        out = self._attend(queries, k, v, q_positions=pos, k_positions=p, window=self.window).output
        self._trim()  # after attending: the step's earlier queries still needed the older keys
        return out

    def score_step(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scored: tuple[int, int]
    ) -> torch.Tensor:
        """A step of another method's scoring pass (KVzip) through a layer that method does not
        hold (a sliding-window layer): the step attends what is held and itself (within the
        window), as a decode step would, and nothing of it is kept or scored."""
        t = keys.shape[2]
        pos = torch.arange(self.seen, self.seen + t, device=keys.device)
        hk, hv, hp = self.store.dense()
        k, v = torch.cat([hk, keys], dim=2), torch.cat([hv, values], dim=2)
        p = torch.cat([hp, pos.expand(*keys.shape[:2], t)], dim=2)
        return self._attend(queries, k, v, q_positions=pos, k_positions=p, window=self.window).output

    def _trim(self) -> None:
        """Drop what no later query can see (nothing, without a window)."""

    def tokens_held(self) -> torch.Tensor:
        assert self.store.positions is not None
        return torch.full(self.store.positions.shape[:2], self.store.positions.shape[2])

    def memory(self) -> dict[str, int]:
        m = self.store.memory()
        return {"kv": m["kv"], "metadata": m["metadata"], "total": m["kv"] + m["metadata"]}


class SlidingWindowLayerCache(FullLayerCache):
    """A sliding-window attention layer (Gemma 3's local layers): keeps only the last ``window`` tokens.

    Such layers are bounded by the model itself, so engines give them this cache whatever the
    method: compressing them further would change the model, and their memory is already fixed.
    Queries see keys less than ``window`` positions behind them, so after each step (multi-token
    steps included, trimmed only once the step has attended) the last ``window`` tokens are kept.
    """

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def _trim(self) -> None:
        excess = len(self.store) - self.window
        if excess > 0:  # tokens no later query can see; copied so the dropped part is really freed
            k = self.store.keys
            assert k is not None
            keep = torch.arange(excess, len(self.store), device=k.device).expand(*k.shape[:2], -1)
            self.store.keep(keep)
