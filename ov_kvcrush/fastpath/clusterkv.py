"""ClusterKV's decode without a host round trip: every head of a layer selected at once on the device.

The reference (:class:`~ov_kvcrush.methods.clusterkv.ClusterKVLayerCache`) walks the ranked
clusters of each KV head in Python (``.tolist()``, ``int(...)``, a set per head for the recall
cache) and concatenates its store every step: on an H100 that made ClusterKV 3× slower per token
than no compression. This layer keeps the reference's semantics (same k-means, same clusters,
the same tokens attended, the same counters; tested against it) with:

* a preallocated store and a step a CUDA graph can replay (:mod:`ov_kvcrush.fastpath.dense`);
* selection as tensor operations over ``[batch * kv_heads, clusters]``: centroid scores ->
  stable ranking -> exclusive prefix sums of the ranked sizes give each cluster's first slot in
  the recall budget -> a token's place is its cluster's start plus its rank inside the cluster,
  and it is recalled when that place is under the budget (the last cluster trimmed to its
  earliest tokens, as in the reference) -> the recalled slots scattered to their places, a fixed
  ``[rows, budget]`` in ranked order; where Triton runs, the same tokens are chosen in two
  launches without ranking (:mod:`ov_kvcrush.kernels.cluster_select`: the budget's boundary
  score by bisection), listed cluster by cluster;
* the recall cache as a ring of boolean masks of the last ``recall_cache_steps`` steps, and its
  counters, updated in place on the device and read only when asked;
* attention over the working set in the model's dtype, read in place from the store (the
  split-key kernel on CUDA): the sinks, the recalled tokens, and a fixed window of
  ``cluster_every`` slots for the generated tokens not clustered yet (the ones not written yet
  masked).

Shapes change only when tokens are clustered (every ``cluster_every`` steps, in
:meth:`FastClusterKVLayerCache.before_step`, outside the graph). Clustering time is measured
(CUDA events on a GPU) as ``clustering_prefill_ms`` (the prompt's) and ``clustering_decode_ms``
(the generated tokens'). A prompt's clustering runs on a stream of its own beside the next
layers' prefill, so on CUDA its events span the overlapped prefill: its cost is the TTFT over the
full cache's, not that span.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch

from ov_kvcrush.fastpath.dense import FastLayerCache
from ov_kvcrush.kernels import use_triton
from ov_kvcrush.methods.base import gather_tokens, tensor_bytes
from ov_kvcrush.methods.clusterkv import (
    ClusterIndex,
    ClusterKVConfig,
    Iterate,
    cluster_tokens,
    lloyd_iterations,
    rank_clusters,
)

# Imported where used, inside functions: what pulls in triton, heavy to import, so that importing
# this module stays light.


def kmeans_iterate(device: torch.device) -> Iterate:
    """k-means' loop on ``device``: the fused Triton iterations where Triton runs (two launches an
    iteration, no host sync; tensor-core TF32 products on CUDA, float32 in the interpreter), the
    reference's loop elsewhere."""
    if not use_triton(device):
        return lloyd_iterations
    from ov_kvcrush.kernels.kmeans import lloyd_on_device

    return functools.partial(lloyd_on_device, precision="tf32" if device.type == "cuda" else "ieee")


@functools.cache
def clustering_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a CUDA device clusters prompts on, beside the next layers' prefill (one per device)."""
    return torch.cuda.Stream(device=device)


#: the recall cache's counters, in the order of :attr:`FastClusterKVLayerCache.recall_counts`
RECALL_COUNTERS = ("cluster_lookups", "cluster_hits", "tokens_loaded")


class FastClusterKVLayerCache(FastLayerCache):
    """ClusterKV state of one layer for the fast path (see the module doc)."""

    #: cluster a prompt on :func:`clustering_stream` beside the next layers' prefill (CUDA); off:
    #: on the current stream, in line
    overlap_clustering = True

    def __init__(self, config: ClusterKVConfig, dense: bool = False, reserve: int = 0) -> None:
        super().__init__(reserve)
        self.config = config
        self.dense_layer = dense
        self.index: ClusterIndex | None = None
        self.sorted_labels: torch.Tensor | None = None  # [rows, N] label of each entry of sorted_tokens
        self.within: torch.Tensor | None = None  # [rows, N] rank of each sorted token inside its cluster
        self.sinks = 0
        self.pending_from = 0
        self.window = 0  # pending slots attended: generated tokens not clustered yet
        self.pending_slots: torch.Tensor | None = None  # [window] store slots of the pending window
        self._pending_key: tuple[int, int, int] | None = None
        self.ring: torch.Tensor | None = None  # [R, rows, C] clusters recalled at the last R steps
        self.ring_ptr: torch.Tensor | None = None  # [1] the ring's next row
        self._last_selected: torch.Tensor | None = None  # [b, hk, S] slots of the last step (-1: masked)
        #: the fused step's selection buffer (:attr:`fused_slots`) when the last step was fused:
        #: its slots past the store's count are masked when :attr:`last_selected` is read
        self._fused_selection: torch.Tensor | None = None
        #: int64 [3]: cluster lookups, hits, tokens loaded (views registered as device counters)
        self.recall_counts: torch.Tensor | None = None
        #: the fused selection's output, [b, hk, sinks + take + window], rebuilt when the shapes change:
        #: sinks and the pending window written once, the recalled middle by every step
        self.fused_slots: torch.Tensor | None = None
        self._clustering: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._side: torch.cuda.Stream | None = None  # a prompt's clustering queued there, not joined yet
        self._iterations_run: list[torch.Tensor] = []  # k-means iterations of each clustering, on the device

    @property
    def counters(self) -> dict[str, float]:
        if self._clustering:
            torch.cuda.synchronize()  # every stream: the clustering's events and counters
        out = FastLayerCache.counters.fget(self)  # type: ignore[attr-defined]
        if self._iterations_run:
            runs = sum(int(t) for t in self._iterations_run)
            out["kmeans_iterations"] = out.get("kmeans_iterations", 0) + float(runs)
        if self._clustering:
            for key, begin, done in self._clustering:
                out[key] = out.get(key, 0.0) + begin.elapsed_time(done)
        if "cluster_lookups" in out:
            out["hit_rate"] = out.get("cluster_hits", 0.0) / out["cluster_lookups"] if out["cluster_lookups"] else 0.0
        return out

    @counters.setter
    def counters(self, value: dict[str, float]) -> None:
        self._host_counters = dict(value)

    # -- clustering (host-side: outside any graph) -----------------------------------------------
    def _after_prefill(self) -> None:
        n = self.buffer.n
        self.sinks = min(self.config.sink_tokens, n)
        self.pending_from = self.sinks
        if not self.dense_layer and n > self.sinks:
            self._cluster(self.sinks, n, self.config.prompt_clusters(n - self.sinks), "prefill")

    def before_step(self, t: int) -> None:
        self.finish_prefill()  # no-op once the engine joined it
        super().before_step(t)
        if self.dense_layer:
            return
        n = self.buffer.n
        if n - self.pending_from >= self.config.cluster_every:
            self._cluster(self.pending_from, n, self.config.new_clusters, "decode")
        window = max(self.config.cluster_every, n + t - self.pending_from)
        key = (self.pending_from, window, self.buffer.capacity)
        if key != self._pending_key:  # new tokens clustered, a longer step, or a larger store
            self._pending_key, self.window = key, window
            slots = torch.arange(self.pending_from, self.pending_from + window, device=self.buffer.keys.device)  # type: ignore[union-attr]
            self.pending_slots = slots.clamp_max(self.buffer.capacity - 1)  # past the store: masked anyway
            self.fused_slots = self._fused_layout()

    def _fused_layout(self) -> torch.Tensor | None:
        """The fused selection's buffer for the current shapes (``None`` where it does not run:
        no Triton here, nothing clustered, or more clusters than one program ranks)."""
        keys = self.buffer.keys
        if keys is None or self.index is None or self.pending_slots is None or not use_triton(keys.device):
            return None
        from ov_kvcrush.kernels.cluster_select import rankable

        if not rankable(self.index.centroids.shape[1]):
            return None  # more clusters a head than one program sorts: the tensor operations select
        assert self.config.budget is not None
        b, hk = keys.shape[:2]
        take = min(self.config.budget - self.sinks, self.index.sorted_tokens.shape[1])
        row = torch.cat(
            [torch.arange(self.sinks, device=keys.device), self.pending_slots.new_zeros(take), self.pending_slots]
        )
        return row.expand(b, hk, -1).contiguous()

    def graph_key(self) -> tuple[Any, ...]:
        clusters = 0 if self.index is None else self.index.centroids.shape[1]
        return (self.buffer.capacity, clusters, self.pending_from, self.window)

    def _cluster(self, start: int, end: int, k: int, phase: str) -> None:
        """Cluster the store slots ``[start, end)`` into ``k`` more clusters. A prompt's clustering
        on CUDA runs on :func:`clustering_stream`, beside the next layers' prefill (the paper's
        overlap); :meth:`finish_prefill` joins it. It never waits for the device."""
        keys = self.buffer.view()[0]
        key = f"clustering_{phase}_ms"
        cuda = keys.device.type == "cuda"
        side = clustering_stream(keys.device) if cuda and phase == "prefill" and self.overlap_clustering else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(keys.device))  # the keys are written
            self._side = side
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if cuda:
                begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            t0 = time.perf_counter()
            cfg = self.config
            self.index, iterations = cluster_tokens(
                self.index, keys, start, end, k, max_iters=cfg.max_iters, seed=cfg.seed + self.seen,
                iterate=kmeans_iterate(keys.device),
            )  # fmt: skip
            self.sorted_labels = torch.sort(self.index.labels, dim=1, stable=True).values
            rank = torch.arange(self.sorted_labels.shape[1], device=keys.device)
            self.within = rank - self.index.offsets.gather(1, self.sorted_labels)
            self._grow_ring(self.index.centroids.shape[1], keys.shape[0] * keys.shape[1], keys.device)
            if isinstance(iterations, torch.Tensor):  # summed when the counters are read
                self._iterations_run.append(iterations)
            else:
                self._bump("kmeans_iterations", iterations)
            if cuda:
                done.record()
                self._clustering.append((key, begin, done))
            else:
                self._bump(key, (time.perf_counter() - t0) * 1e3)
        self.pending_from = end
        self._pending_key = None
        self._bump("clusterings")

    def finish_prefill(self) -> None:
        """The current stream waits for the prompt's clustering (queued on the side stream), and
        the tensors it made are marked as used there: call before anything reads the index."""
        side, self._side = self._side, None
        if side is None:
            return
        main = torch.cuda.current_stream(side.device)
        main.wait_stream(side)
        made = [*vars(self.index).values(), self.sorted_labels, self.within, self.ring, self.ring_ptr]
        for t in made + self._iterations_run + list(self._device_counters.values()):
            if isinstance(t, torch.Tensor):
                t.record_stream(main)

    def _grow_ring(self, clusters: int, rows: int, device: torch.device) -> None:
        """The recall cache, widened to ``clusters`` (new clusters were recalled by no step yet)."""
        r = self.config.recall_cache_steps
        if not r:
            return
        old = self.ring
        self.ring = torch.zeros((r, rows, clusters), dtype=torch.int8, device=device)  # int8: Triton writes it
        if old is not None:
            self.ring[:, :, : old.shape[2]] = old
        if self.ring_ptr is None:
            self.ring_ptr = torch.zeros(1, dtype=torch.long, device=device)

    # -- decode (device only) ---------------------------------------------------------------------
    def step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.dense_layer:
            return super().step(queries, keys, values)
        self._write(keys, values)
        assert self.pending_slots is not None and self.n_dev is not None
        if self.fused_slots is not None:
            return self._fused_step(queries, self.fused_slots)
        b, hk = keys.shape[:2]
        slots, visible = self._select(queries, b, hk, self.pending_slots, self.pending_slots < self.n_dev)
        self._fused_selection, self._last_selected = None, torch.where(visible, slots, -1)
        return self._attend_store(queries, self._last_selected)

    def _fused_step(self, queries: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The selection in two launches (:mod:`ov_kvcrush.kernels.cluster_select`) written into
        ``slots``, then attention over them in place (the pending window's unwritten slots masked
        by the store's count): the same tokens (in cluster order) and counters as :meth:`_select`."""
        from ov_kvcrush.kernels.cluster_select import select_recalled

        idx = self.index
        assert idx is not None and self.config.budget is not None and self.n_dev is not None
        rows = slots.shape[0] * slots.shape[1]
        select_recalled(
            queries, idx.centroids, idx.sizes, idx.offsets, idx.sorted_tokens,
            budget=self.config.budget - self.sinks, slots=slots.view(rows, -1), offset=self.sinks,
            counts=self._recall_counts(queries.device), ring=self.ring, ring_ptr=self.ring_ptr,
        )  # fmt: skip
        self._fused_selection, self._last_selected = slots, None  # masked when read: no launch a step
        return self._attend_store(queries, slots)

    def _recall_counts(self, device: torch.device, names: tuple[str, ...] = RECALL_COUNTERS) -> torch.Tensor:
        """The recall cache's counters on the device, registered (as ``names``) on first use."""
        if self.recall_counts is None:
            self.recall_counts = torch.zeros(len(RECALL_COUNTERS), dtype=torch.long, device=device)
        for i, name in enumerate(RECALL_COUNTERS):
            if name in names and name not in self._device_counters:
                self._device_counters[name] = self.recall_counts[i]
        return self.recall_counts

    def _multi_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.dense_layer:
            return super()._multi_step(queries, keys, values)
        t = keys.shape[2]
        k, v = self._write_each(keys, values)
        pending = torch.arange(self.pending_from, k.shape[2], device=keys.device)
        b, hk = keys.shape[:2]
        slots, _ = self._select(queries, b, hk, pending, torch.ones_like(pending, dtype=torch.bool))
        self._fused_selection, self._last_selected = None, slots
        pos = torch.arange(self.seen, self.seen + t, device=keys.device)
        return self._attend(
            queries, gather_tokens(k, slots), gather_tokens(v, slots), q_positions=pos, k_positions=slots
        ).output

    def _select(
        self, queries: torch.Tensor, b: int, hk: int, pending: torch.Tensor, pending_visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, hk, S]`` slots attended (sinks, recalled, pending) and ``[S]`` which are real (the
        same for every head: only the pending window's unwritten slots are not)."""
        dev = queries.device
        rows = b * hk
        parts = [torch.arange(self.sinks, device=dev).expand(rows, -1)]
        if self.index is not None:
            assert self.config.budget is not None and self.sorted_labels is not None and self.within is not None
            idx = self.index
            budget = self.config.budget - self.sinks
            order = rank_clusters(queries, idx.centroids, hk)  # [rows, C]
            ranked = idx.sizes.gather(1, order)
            start = torch.empty_like(ranked).scatter_(1, order, ranked.cumsum(1) - ranked)  # first budget slot
            # A clustered token's place in the ranked order: its cluster's first slot plus its rank
            # inside the cluster. These places are a permutation of 0..N-1, so the recalled ones
            # (under the budget) fill 0..take-1 exactly, in ranked order; the rest land in a spare
            # column that is dropped.
            take = min(budget, idx.sorted_tokens.shape[1])
            dest = (start.gather(1, self.sorted_labels) + self.within).clamp_max(take)  # [rows, N]
            compact = idx.sorted_tokens.new_zeros((rows, take + 1)).scatter_(1, dest, idx.sorted_tokens)
            parts.append(compact[:, :take])
            self._account(start < budget, idx.sizes)
        else:  # nothing clustered yet (a prompt of sinks only): the reference counts empty lookups
            self._recall_counts(dev, RECALL_COUNTERS[:2])
        fixed = sum(p.shape[1] for p in parts)
        parts.append(pending.expand(rows, -1))
        slots = torch.cat(parts, dim=1).reshape(b, hk, -1)
        visible = torch.cat([torch.ones(fixed, dtype=torch.bool, device=dev), pending_visible])
        return slots, visible

    def _account(self, picked: torch.Tensor, sizes: torch.Tensor) -> None:
        """The recall cache: a recalled cluster is a hit when one of the last R steps recalled it."""
        chosen = picked & (sizes > 0)
        cached = self.ring.any(0) if self.ring is not None else torch.zeros_like(chosen)
        counts = self._recall_counts(chosen.device)
        counts[0].add_(chosen.sum())
        counts[1].add_((chosen & cached).sum())
        counts[2].add_((sizes * (chosen & ~cached)).sum())
        if self.ring is not None and self.ring_ptr is not None:
            self.ring.index_copy_(0, self.ring_ptr, chosen[None].to(self.ring.dtype))
            self.ring_ptr.add_(1).remainder_(self.ring.shape[0])

    # -- what is held ---------------------------------------------------------------------------
    @property
    def last_selected(self) -> torch.Tensor | None:
        """``[b, hk, S]`` store slots the last decode step attended (``-1``: none). After a fused
        step, the selection buffer with the pending window's slots not written by then masked
        (read after the step: the store's count is the step's)."""
        if self._fused_selection is not None:
            return torch.where(self._fused_selection < self.buffer.n, self._fused_selection, -1)
        return self._last_selected

    def tokens_attended(self) -> torch.Tensor:
        """``[b, hk]`` tokens the last decode step attended."""
        if self.last_selected is None:
            return self.tokens_held()
        return (self.last_selected >= 0).sum(-1)

    def decode_read_bytes(self) -> int:
        """What the fused step reads: the centroids, the sizes and the recall cache's ring (every
        cluster is scored and ranked), a slot per recalled token, and the attended tokens (the
        sinks, the recalled, the pending window)."""
        idx = self.index
        if self.dense_layer or idx is None:
            return super().decode_read_bytes()
        assert self.config.budget is not None
        rows = idx.sizes.shape[0]
        take = min(self.config.budget - self.sinks, idx.sorted_tokens.shape[1])
        ranking = tensor_bytes(idx.centroids, idx.sizes, self.ring) + rows * take * idx.sorted_tokens.element_size()
        return ranking + (self.sinks + take + self.window) * self.token_bytes()

    def _metadata(self) -> list[torch.Tensor | None]:
        idx = self.index
        index = (
            [] if idx is None else [idx.centroids, idx.sizes, idx.offsets, idx.sorted_tokens, idx.labels, idx.tokens]
        )
        state = [self.sorted_labels, self.within, self.pending_slots, self.ring, self.ring_ptr, self._last_selected]
        state.append(self.fused_slots)  # recall_counts: counted as the device counters' views
        return [*super()._metadata(), *index, *state]
