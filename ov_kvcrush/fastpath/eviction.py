"""H2O, SnapKV, PyramidKV and StreamingLLM decoding in fixed-size tensors, replayable as a CUDA graph.

The reference (:class:`~ov_kvcrush.methods.importance.ImportanceLayerCache`) appends each token to
a store of ``budget`` tokens per KV head, attends with per-head scores, adds them to the
accumulated scores and, over budget, keeps the sinks, the recent window and the top scores
between (:func:`~ov_kvcrush.methods.selection.keep_indices`). Once the store is full every step
has the same shapes: ``budget + 1`` tokens attended, one evicted per head. This layer runs exactly
that arithmetic, with the reference's own selection and score gathering, in preallocated
``[b, hk, budget + 1]`` tensors: the new token is written into the spare last slot, and the kept
``budget`` are gathered back to the front, in the reference's order (so ties break the same way).
The step does no host work, so the engine replays it as a CUDA graph.

The reference layer does the prefill (through the fused kernels) and every step this layer cannot
do in fixed shapes: while the store is not full yet (a prompt shorter than the budget), and steps
of several tokens; its state is handed back and forth around those steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ov_kvcrush.fastpath.dense import FastLayerCache
from ov_kvcrush.methods.base import gather_tokens, tensor_bytes
from ov_kvcrush.methods.importance import EvictionConfig, ImportanceLayerCache


class FastEvictionLayerCache(FastLayerCache):
    """One layer of an importance-eviction method for the fast path (see the module doc)."""

    def __init__(self, config: EvictionConfig, layer_idx: int, num_layers: int) -> None:
        super().__init__()
        ref = config.make_layer(layer_idx, num_layers)
        assert isinstance(ref, ImportanceLayerCache)
        self.reference: ImportanceLayerCache = ref
        self.budget = ref.budget
        self.keys: torch.Tensor | None = None  # [b, hk, budget + 1, d]; the last slot takes the new token
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [b, hk, budget + 1] long
        self.acc: torch.Tensor | None = None  # [b, hq, budget + 1] float32, per query head
        self.position: torch.Tensor | None = None  # [1] long: the next token's position
        self.fixed = False  # whether the state is in the fixed-size tensors (else in the reference)
        self._advanced = False  # the last step was the reference's, which counted its tokens itself

    # -- the reference's state, handed over -------------------------------------------------------
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ref = self.reference
        ref.scale, ref.prompt_memo = self.scale, self.prompt_memo
        out = ref.prefill(queries, keys, values)
        self.seen, self.attend_ms = ref.seen, ref.attend_ms
        self._take_over()
        return out

    def _take_over(self) -> None:
        """Move the reference's store into the fixed tensors once it holds ``budget`` per head."""
        ref = self.reference
        k, v, p = ref.store.dense()
        if k.shape[2] != self.budget or ref.acc is None or bool((p < 0).any()):
            return
        b, hk, _, d = k.shape
        spare = self.budget + 1
        if self.keys is None:
            self.keys = k.new_zeros((b, hk, spare, d))
            self.values = torch.zeros_like(self.keys)
            self.positions = p.new_zeros((b, hk, spare))
            self.acc = ref.acc.new_zeros((b, ref.acc.shape[1], spare))
            self.position = torch.zeros(1, dtype=torch.long, device=k.device)
        assert self.values is not None and self.positions is not None and self.acc is not None
        assert self.position is not None
        self.keys[:, :, : self.budget] = k
        self.values[:, :, : self.budget] = v
        self.positions[:, :, : self.budget] = p
        self.acc[:, :, : self.budget] = ref.acc
        self.position.fill_(self.seen)
        self.fixed = True

    def _hand_back(self) -> None:
        """Give the state back to the reference (before a step only it can do)."""
        if not self.fixed:
            return
        assert self.keys is not None and self.values is not None and self.positions is not None
        assert self.acc is not None
        n = self.budget
        self.reference.store.replace(
            self.keys[:, :, :n].clone(), self.values[:, :, :n].clone(), self.positions[:, :, :n].clone()
        )
        self.reference.acc = self.acc[:, :, :n].clone()
        self.reference.seen = self.seen
        self.reference.counters = self.counters
        self._device_counters.clear()
        self._host_counters.clear()
        self.fixed = False

    @property
    def counters(self) -> dict[str, float]:
        out = dict(self.reference.counters)
        for key, value in FastLayerCache.counters.fget(self).items():  # type: ignore[attr-defined]
            out[key] = out.get(key, 0.0) + value
        return out

    @counters.setter
    def counters(self, value: dict[str, float]) -> None:
        self._host_counters = dict(value)

    # -- decode -----------------------------------------------------------------------------------
    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.fixed and keys.shape[2] == 1:
            out = self.step(queries, keys, values)
            if not self.graphed:
                self.after_step(1)
            return out
        self._hand_back()
        ref = self.reference
        ref.scale = self.scale
        out = ref.decode(queries, keys, values)
        self.seen = ref.seen
        self._advanced = self.graphed  # the engine's after_step must not count this step again
        self._take_over()
        return out

    def before_step(self, t: int) -> None:
        pass

    def after_step(self, t: int) -> None:
        if not self._advanced:
            self.seen += t
        self._advanced = False

    def graph_key(self) -> tuple[Any, ...] | None:
        """Fixed shapes once the store is full; before that, the reference's steps run eagerly."""
        return (self.budget,) if self.fixed else None

    def step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        k, v, p, acc, pos = self.keys, self.values, self.positions, self.acc, self.position
        assert k is not None and v is not None and p is not None and acc is not None and pos is not None
        n = self.budget
        k[:, :, n : n + 1] = keys
        v[:, :, n : n + 1] = values
        p[:, :, n] = pos
        pos.add_(1)
        res = self._attend(queries, k, v, return_scores=True)  # every slot is held: no mask
        assert res.scores is not None
        acc[:, :, n] = 0.0
        acc.add_(res.scores)
        hk = k.shape[1]
        ref = self.reference
        index = ref.select(acc, hk)  # [b, hk, budget]: the reference's choice, ascending
        kept_acc = ref.gather_scores(acc, index)
        k[:, :, :n] = gather_tokens(k, index)
        v[:, :, :n] = gather_tokens(v, index)
        p[:, :, :n] = torch.gather(p, 2, index)
        acc[:, :, :n] = kept_acc
        self._add("evicted", torch.full((), float(k.shape[0] * hk), device=k.device))
        return res.output

    # -- what is held ---------------------------------------------------------------------------
    def tokens_held(self) -> torch.Tensor:
        if not self.fixed or self.keys is None:
            return self.reference.tokens_held()
        return torch.full(self.keys.shape[:2], self.budget, dtype=torch.long)

    def memory(self) -> dict[str, int]:
        if not self.fixed:
            return self.reference.memory()
        kv = tensor_bytes(self.keys, self.values)
        meta = tensor_bytes(self.positions, self.acc, self.position, *self._device_counters.values())
        return {"kv": kv, "metadata": meta, "total": kv + meta}
