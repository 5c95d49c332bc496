"""The fast path's base layer: a preallocated store, and decode steps a CUDA graph can replay.

A CUDA graph replays the kernels a step launched when it was captured, with the same shapes and
the same memory; the Python that launched them does not run again. So a capturable decode step
must (1) keep every value that changes from step to step in device tensors updated in place (the
token count ``n_dev``, counters, the recall cache), (2) read no Python state that changes between
steps, and (3) never wait for the device (no ``.item()``, no ``bool(tensor)``). The layers here
split each step in three:

* :meth:`FastLayerCache.before_step` (Python, outside any graph): the host-side work a step
  needs: growing the store, a method's periodic work (ClusterKV's clustering of new tokens);
  it may change :meth:`FastLayerCache.graph_key`, the shapes the step is captured with;
* :meth:`FastLayerCache.step` (device only, capturable): append the token at ``n_dev``, attend;
* :meth:`FastLayerCache.after_step` (Python): advance the host's count of tokens.

:meth:`LayerCache.decode` runs the three in order (eager, any device); the engine's
:class:`~ov_kvcrush.engines.cuda_graph.GraphedDecoder` runs ``before_step``, replays the graph
of every layer's ``step``, then ``after_step``. A step of several tokens (a chat turn) runs
eagerly with the reference's causal positions.

:class:`FastLayerCache` itself attends everything it holds: the ``full`` method, and the dense
layers of ClusterKV.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from ov_kvcrush.fastpath.buffer import KVBuffer
from ov_kvcrush.kernels import use_triton
from ov_kvcrush.methods.base import LayerCache, gather_tokens, tensor_bytes

# Imported where used, inside functions: what pulls in triton, heavy to import, so that importing
# this module stays light.


class FastLayerCache(LayerCache):
    """Full attention over a preallocated store (see the module doc).

    Args:
        reserve: tokens the layer will receive after the prompt (preallocated, so a whole
            generation keeps one store and the graph keeps its addresses).
    """

    softcap_refusal = "the CUDA fast path's kernels (Triton, SDPA) take raw logits; the CPU runs it"

    def __init__(self, reserve: int = 0) -> None:
        self._device_counters: dict[str, torch.Tensor] = {}
        super().__init__()
        self.buffer = KVBuffer(reserve)
        self.n_dev: torch.Tensor | None = None  # [1] long: tokens held, on the device
        #: set by the engine while it replays captured steps (it calls before/after_step itself)
        self.graphed = False

    # -- counters: host numbers, plus device tensors read only on request -------------------
    @property
    def counters(self) -> dict[str, float]:
        out = dict(self._host_counters)
        for key, value in self._device_counters.items():
            out[key] = float(value)
        return out

    @counters.setter
    def counters(self, value: dict[str, float]) -> None:
        self._host_counters = dict(value)

    def _bump(self, key: str, amount: float = 1) -> None:
        self._host_counters[key] = self._host_counters.get(key, 0) + amount

    def _add(self, key: str, amount: torch.Tensor) -> None:
        """Add to a device counter in place (a replayed graph adds into the same tensor)."""
        if key not in self._device_counters:
            self._device_counters[key] = torch.zeros((), dtype=torch.float64, device=amount.device)
        self._device_counters[key].add_(amount)

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        out = self._attend(queries, keys, values, q_positions=pos, k_positions=pos).output
        self.buffer.append(keys, values)
        self.n_dev = torch.full((1,), self.buffer.n, dtype=torch.long, device=keys.device)
        self._after_prefill()
        return out

    def _after_prefill(self) -> None:
        pass

    def finish_prefill(self) -> None:
        """Wait (on the device, not the host) for work :meth:`_after_prefill` queued beside the
        prefill; nothing here (ClusterKV's clustering stream joins)."""

    # -- decode ---------------------------------------------------------------------------------
    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.graphed:
            return self.step(queries, keys, values)
        t = keys.shape[2]
        self.before_step(t)
        out = self.step(queries, keys, values) if t == 1 else self._multi_step(queries, keys, values)
        self.after_step(t)
        return out

    def before_step(self, t: int) -> None:
        """Host work before a step of ``t`` tokens: room in the store for them."""
        self.buffer.reserve_for(t)

    def after_step(self, t: int) -> None:
        """Advance the host's counts after a step of ``t`` tokens."""
        self.seen += t
        self.buffer.n += t

    def graph_key(self) -> tuple[Any, ...] | None:
        """What a captured step depends on: the store's capacity (its addresses). ``None``: the
        next step does host work inside it (run it eagerly, capture nothing)."""
        return (self.buffer.capacity,)

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one token at ``n_dev`` (in place) and count it: one launch where Triton runs
        (:func:`~ov_kvcrush.kernels.kv_store.append_token`), three torch operations elsewhere."""
        assert self.n_dev is not None and self.buffer.keys is not None and self.buffer.values is not None
        if use_triton(keys.device):
            from ov_kvcrush.kernels.kv_store import append_token  # Triton: imported where it runs

            append_token(self.buffer.keys, self.buffer.values, keys, values, self.n_dev)
            return
        self.buffer.keys.index_copy_(2, self.n_dev, keys)
        self.buffer.values.index_copy_(2, self.n_dev, values)
        self.n_dev.add_(1)

    def _write_each(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a step's tokens one by one (eager steps of several tokens); the held keys and
        values afterwards (views)."""
        n, t = self.buffer.n, keys.shape[2]
        for i in range(t):
            self._write(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        assert self.buffer.keys is not None and self.buffer.values is not None
        return self.buffer.keys[:, :, : n + t], self.buffer.values[:, :, : n + t]

    def step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One token, device work only: append it, attend every held token (the rest of the
        store's capacity masked)."""
        self._write(keys, values)
        return self._attend_store(queries)

    def _attend_store(self, queries: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token's attention over the store in place: its held prefix, or per KV head the
        store ``slots`` ``[b, hk, L]`` (``-1``: none; slots not written yet are masked too).

        Where Triton runs (CUDA), the split-key kernel :func:`~ov_kvcrush.kernels.decode.decode_attention`
        reads the attended slots in place; elsewhere they are gathered for fused SDPA with a mask.
        """
        k, v = self.buffer.keys, self.buffer.values
        assert k is not None and v is not None and self.n_dev is not None
        if use_triton(queries.device):
            from ov_kvcrush.kernels.decode import decode_attention

            return decode_attention(queries, k, v, self.scale, length=self.n_dev, slots=slots)
        if slots is None:
            visible = torch.arange(k.shape[2], device=k.device) < self.n_dev
            return self._sdpa(queries, k, v, visible.view(1, 1, 1, -1))
        held = slots.clamp_min(0)
        visible = (slots >= 0) & (slots < self.n_dev)
        return self._sdpa(queries, gather_tokens(k, held), gather_tokens(v, held), visible[:, :, None, :])

    def _multi_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Several tokens at once (eager): causal by positions, as the reference attends them."""
        t = keys.shape[2]
        k, v = self._write_each(keys, values)
        pos = torch.arange(self.seen, self.seen + t, device=keys.device)
        return self._attend(
            queries, k, v, q_positions=pos, k_positions=torch.arange(k.shape[2], device=k.device)
        ).output

    def _sdpa(self, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One query token's attention in the model's dtype (fused SDPA), timed on the CPU.

        ``mask``: ``[b|1, hk|1, 1, S]`` bool, per KV head. The query heads of a KV head become its
        query rows (``[b, hk, group, d]``), so the keys are read once per KV head: SDPA's own
        grouped-query path copies them per query head on every backend that takes a mask.
        """
        t0 = time.perf_counter()
        b, hq, _, d = queries.shape
        hk = k.shape[1]
        rows = queries.reshape(b, hk, hq // hk, d)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=self.scale).reshape(b, hq, 1, d)
        if queries.device.type == "cpu":
            self.attend_ms += (time.perf_counter() - t0) * 1e3
        return out

    # -- what is held ---------------------------------------------------------------------------
    def tokens_held(self) -> torch.Tensor:
        assert self.buffer.keys is not None
        return torch.full(self.buffer.keys.shape[:2], self.buffer.n, dtype=torch.long)

    def _metadata(self) -> list[torch.Tensor | None]:
        return [self.n_dev, *self._device_counters.values()]

    def memory(self) -> dict[str, int]:
        kv = self.buffer.nbytes()
        meta = tensor_bytes(*self._metadata())
        return {"kv": kv, "metadata": meta, "total": kv + meta}

    def token_bytes(self) -> int:
        """Bytes of one token's key and value over every row and KV head of the store."""
        k = self.buffer.keys
        assert k is not None
        return 2 * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()

    def decode_read_bytes(self) -> int:
        """Everything held less the store's spare capacity (slots not written yet are never read)."""
        total = self.memory()["total"]
        if self.buffer.keys is None:  # a layer that keeps its tokens elsewhere
            return total
        return total - (self.buffer.capacity - self.buffer.n) * self.token_bytes()
