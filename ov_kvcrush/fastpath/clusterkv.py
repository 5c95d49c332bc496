"""ClusterKV's decode without a host round trip: every head of a layer selected at once on the device.

The reference (:class:`~ov_kvcrush.methods.clusterkv.ClusterKVLayerCache`) walks the ranked
clusters of each KV head in Python (``.tolist()``, ``int(...)``, a set per head for the recall
cache) and concatenates its store every step: on an H100 that made ClusterKV 3× slower per token
than no compression. This layer keeps the reference's semantics (same k-means, same clusters,
the same tokens attended, the same counters; tested against it) with:

* a preallocated store (:class:`~ov_kvcrush.fastpath.buffer.KVBuffer`);
* selection as tensor operations over ``[batch * kv_heads, clusters]``: centroid scores ->
  stable ranking -> exclusive prefix sums of the ranked sizes give each cluster's first slot in
  the recall budget -> a token is recalled when its cluster's start plus its rank inside the
  cluster is under the budget (the last cluster trimmed to its earliest tokens, as in the
  reference) -> the recalled slots compacted by a prefix sum into a fixed ``[rows, budget]``;
* the recall cache as boolean masks of the last ``recall_cache_steps`` steps, its counters kept
  on the device and read only when asked;
* attention over the gathered working set in the model's dtype (fused SDPA).

Shapes are fixed between clusterings: the working set is ``sinks + budget - sinks`` recalled
tokens plus the generated tokens not clustered yet. Clustering time is measured (CUDA events on
a GPU) as ``clustering_prefill_ms`` (the prompt's) and ``clustering_decode_ms`` (the generated
tokens'), so reports give it as a share of prefill.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch
import torch.nn.functional as F

from ov_kvcrush.fastpath.buffer import KVBuffer
from ov_kvcrush.methods.base import LayerCache, gather_tokens, tensor_bytes
from ov_kvcrush.methods.clusterkv import ClusterIndex, ClusterKVConfig, kmeans_cosine, rank_clusters


class FastClusterKVLayerCache(LayerCache):
    """ClusterKV state of one layer for the fast path (see the module doc)."""

    def __init__(self, config: ClusterKVConfig, dense: bool = False, reserve: int = 0) -> None:
        self._device_counters: dict[str, torch.Tensor] = {}
        super().__init__()
        self.config = config
        self.dense_layer = dense
        self.buffer = KVBuffer(reserve)
        self.index: ClusterIndex | None = None
        self.sorted_labels: torch.Tensor | None = None  # [rows, N] label of each entry of sorted_tokens
        self.within: torch.Tensor | None = None  # [rows, N] rank of each sorted token inside its cluster
        self.sinks = 0
        self.pending_from = 0
        self.recent: deque[torch.Tensor] = deque(maxlen=max(config.recall_cache_steps, 1))
        self.last_selected: torch.Tensor | None = None
        self._clustering: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    # -- counters: device tensors, read on request ---------------------------------------------
    @property
    def counters(self) -> dict[str, float]:
        out = dict(self._host_counters)
        for key, value in self._device_counters.items():
            out[key] = float(value)
        if self._clustering:
            torch.cuda.synchronize()
            for key, begin, done in self._clustering:
                out[key] = out.get(key, 0.0) + begin.elapsed_time(done)
        if "cluster_lookups" in out:
            out["hit_rate"] = out.get("cluster_hits", 0.0) / out["cluster_lookups"] if out["cluster_lookups"] else 0.0
        return out

    @counters.setter
    def counters(self, value: dict[str, float]) -> None:
        self._host_counters = dict(value)

    def _bump(self, key: str, amount: float = 1) -> None:
        self._host_counters[key] = self._host_counters.get(key, 0) + amount

    def _add(self, key: str, amount: torch.Tensor) -> None:
        held = self._device_counters.get(key)
        self._device_counters[key] = amount.to(torch.float64) if held is None else held + amount

    # -- prefill and clustering -------------------------------------------------------------------
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pos = self._start_prefill(queries, keys, values)
        out = self._attend(queries, keys, values, q_positions=pos, k_positions=pos).output
        self.buffer.append(keys, values)
        n = keys.shape[2]
        self.sinks = min(self.config.sink_tokens, n)
        self.pending_from = self.sinks
        if not self.dense_layer and n > self.sinks:
            c0 = self.config.n_clusters or math.ceil((n - self.sinks) / self.config.tokens_per_cluster)
            self._cluster(self.buffer.view()[0], self.sinks, n, c0, "prefill")
        return out

    def _cluster(self, keys: torch.Tensor, start: int, end: int, k: int, phase: str) -> None:
        key = f"clustering_{phase}_ms"
        cuda = keys.device.type == "cuda"
        if cuda:
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t0 = time.perf_counter()
        b, hk, _, d = keys.shape
        km = kmeans_cosine(
            keys[:, :, start:end].reshape(b * hk, end - start, d),
            k,
            max_iters=self.config.max_iters,
            seed=self.config.seed + self.seen,
        )
        tokens = torch.arange(start, end, device=keys.device)
        if self.index is None:
            self.index = ClusterIndex.build(km.centroids, km.labels, tokens)
        else:
            self.index = self.index.extend(km.centroids, km.labels, tokens)
            grow = self.index.centroids.shape[1] - self.recent[0].shape[1] if self.recent else 0
            self.recent = deque((F.pad(m, (0, grow)) for m in self.recent), maxlen=self.recent.maxlen)
        self.sorted_labels = torch.sort(self.index.labels, dim=1, stable=True).values
        rank = torch.arange(self.sorted_labels.shape[1], device=keys.device)
        self.within = rank - self.index.offsets.gather(1, self.sorted_labels)
        self.pending_from = end
        self._bump("clusterings")
        self._bump("kmeans_iterations", km.iterations)
        if cuda:
            done.record()
            self._clustering.append((key, begin, done))
        else:
            self._bump(key, (time.perf_counter() - t0) * 1e3)

    # -- decode ---------------------------------------------------------------------------------
    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        n = self.buffer.n
        if not self.dense_layer and n - self.pending_from >= self.config.cluster_every:
            self._cluster(self.buffer.view()[0], self.pending_from, n, self.config.new_clusters, "decode")
        pos = self._positions(keys.shape[2], keys.device)
        self.buffer.append(keys, values)
        k, v = self.buffer.view()
        if self.dense_layer:
            return self._attend_step(queries, k, v, pos, None)
        slots = self._select(queries, k.shape[0], k.shape[1])
        self.last_selected = slots
        return self._attend_step(queries, gather_tokens(k, slots), gather_tokens(v, slots), pos, slots)

    def _attend_step(
        self, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """One step's attention in the model's dtype; several query tokens need the causal mask."""
        if queries.shape[2] > 1:
            k_pos = torch.arange(k.shape[2], device=k.device) if slots is None else slots
            return self._attend(queries, k, v, q_positions=pos, k_positions=k_pos).output
        t0 = time.perf_counter()
        hq, hk = queries.shape[1], k.shape[1]
        out = F.scaled_dot_product_attention(queries, k, v, scale=self.scale, enable_gqa=hq != hk)
        if queries.device.type == "cpu":
            self.attend_ms += (time.perf_counter() - t0) * 1e3
        return out

    def _select(self, queries: torch.Tensor, b: int, hk: int) -> torch.Tensor:
        """``[b, hk, sinks + recalled + pending]`` slots attended this step (no host synchronisation)."""
        n, dev = self.buffer.n, queries.device
        rows = b * hk
        parts = [torch.arange(self.sinks, device=dev).expand(rows, -1)]
        if self.index is not None:
            assert self.config.budget is not None and self.sorted_labels is not None and self.within is not None
            idx = self.index
            budget = self.config.budget - self.sinks
            order = rank_clusters(queries, idx.centroids, hk)  # [rows, C]
            ranked = idx.sizes.gather(1, order)
            start = torch.empty_like(ranked).scatter_(1, order, ranked.cumsum(1) - ranked)  # first budget slot
            recalled = start.gather(1, self.sorted_labels) + self.within < budget  # [rows, N]
            take = min(budget, idx.sorted_tokens.shape[1])
            dest = torch.where(recalled, recalled.cumsum(1) - 1, take)
            compact = idx.sorted_tokens.new_zeros((rows, take + 1)).scatter_(1, dest, idx.sorted_tokens)
            parts.append(compact[:, :take])
            self._account(start < budget, idx.sizes)
        else:  # nothing clustered yet (a prompt of sinks only): the reference counts empty lookups
            self._add("cluster_lookups", torch.zeros((), device=dev))
            self._add("cluster_hits", torch.zeros((), device=dev))
        parts.append(torch.arange(self.pending_from, n, device=dev).expand(rows, -1))
        return torch.cat(parts, dim=1).reshape(b, hk, -1)

    def _account(self, picked: torch.Tensor, sizes: torch.Tensor) -> None:
        """The recall cache: a recalled cluster is a hit when one of the last R steps recalled it."""
        chosen = picked & (sizes > 0)
        r = self.config.recall_cache_steps
        cached = torch.zeros_like(chosen)
        if r:
            for mask in self.recent:
                cached |= mask
        self._add("cluster_lookups", chosen.sum())
        self._add("cluster_hits", (chosen & cached).sum())
        self._add("tokens_loaded", (sizes * (chosen & ~cached)).sum())
        if r:
            self.recent.append(chosen)

    # -- what is held ---------------------------------------------------------------------------
    def tokens_held(self) -> torch.Tensor:
        assert self.buffer.keys is not None
        return torch.full(self.buffer.keys.shape[:2], self.buffer.n, dtype=torch.long)

    def tokens_attended(self) -> torch.Tensor:
        """``[b, hk]`` tokens the last decode step attended."""
        if self.last_selected is None:
            return self.tokens_held()
        return torch.full(self.last_selected.shape[:2], self.last_selected.shape[2])

    def memory(self) -> dict[str, int]:
        kv = self.buffer.nbytes()
        meta = tensor_bytes(
            self.last_selected, self.sorted_labels, self.within, *self.recent, *self._device_counters.values()
        )
        if self.index is not None:
            meta += self.index.nbytes()
        return {"kv": kv, "metadata": meta, "total": kv + meta}
