"""ClusterKV's layer cache over the GPU path's device pool: every token held, each decode step
attending the sinks, the clusters its query recalls and the tokens not clustered yet.

The steps are the reference's (:class:`~ov_kvcrush.methods.clusterkv.ClusterKVLayerCache`), on
the device: the prompt's keys past the sinks clustered by cosine k-means from the reference's
seeded picks (``clusterkv.cl``; the keys read from the pool in place, ``paged_store.cl``'s
``read_slots``), every ``cluster_every`` generated tokens clustered into ``new_clusters`` more,
the index (centroids, the slots sorted by cluster) grown on the device; per step the centroids
ranked by the query, whole clusters recalled up to the budget, and the list of slots attended
built there. What crosses per decode step beside the model's tensors: the recalled count per KV
head (and, when tokens are clustered, one int per k-means iteration and the new clusters'
sizes). The recall cache's hit counters are the reference's alone (they are statistics, and
would need the chosen clusters on the host).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu.clusterkv import launch_kmeans, launch_recall
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache, host_array
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.methods import MethodConfig
from ov_kvcrush.methods.clusterkv import ClusterKVConfig, initial_picks


class DeviceRecallLayerCache(DeviceFullLayerCache):
    """Shared by ClusterKV and Quest, as the reference's ``RecallLayerCache``: every token held,
    each decode step of one token attending the slots the method recalls for its query (a
    ``dense`` layer attends everything)."""

    def __init__(self, config: MethodConfig, pool: DevicePool, kv_heads: int, q_heads: int, dense: bool) -> None:
        super().__init__(pool, kv_heads, q_heads)
        self.config = config
        self.dense_layer = dense

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._start_prefill(queries, keys, values)
        out = self._step(queries, keys, values, 0)
        self._after_prefill()
        return out

    def _after_prefill(self) -> None:
        """The method's index over the prompt (ClusterKV's clusters, Quest's page bounds)."""

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        t = keys.shape[2]
        self.layer.pool.phase = "decode"
        if self.dense_layer:
            self._positions(t, keys.device)
            return self._step(queries, keys, values, 0)
        if t != 1:
            raise UserError(
                f"{self.config.name} on the GPU path (paged_device) decodes one token per step (a step of several came)"
            )
        self._before_append()
        self._positions(t, keys.device)
        self.layer.append(host_array(keys), host_array(values), self.seen - 1)
        self._after_append()
        q = np.ascontiguousarray(host_array(queries)[:, 0])
        return torch.from_numpy(self._attend_recalled(q))[None, :, None].to(queries.dtype)

    def _before_append(self) -> None:
        """What the method does before the step's token is stored (ClusterKV: cluster when due)."""

    def _after_append(self) -> None:
        """What the method does once it is stored (Quest: the last page's bounds again)."""

    def _attend_recalled(self, q: np.ndarray) -> np.ndarray:
        """The query ``[Hq, D]`` over the slots recalled for it: the output ``[Hq, D]``."""
        raise NotImplementedError


class DeviceClusterKVLayerCache(DeviceRecallLayerCache):
    """ClusterKV over the device pool."""

    config: ClusterKVConfig

    def __init__(self, config: ClusterKVConfig, pool: DevicePool, kv_heads: int, q_heads: int, dense: bool) -> None:
        super().__init__(config, pool, kv_heads, q_heads, dense)
        self.sinks = 0
        self.pending_from = 0  # slots >= this are generated tokens not clustered yet
        self.clusters = 0  # C: clusters per KV head
        self.clustered = 0  # N: slots clustered per KV head
        self.sizes = np.zeros((kv_heads, 0), np.int32)
        # the index on the device: centroids [kv, C, D], sizes [kv, C], offsets [kv, C + 1], sorted slots [kv, N]
        self.index: tuple[Any, Any, Any, Any] | None = None

    def _after_prefill(self) -> None:
        n = self.layer.held
        self.sinks = min(self.config.sink_tokens, n)
        self.pending_from = self.sinks
        if not self.dense_layer and n > self.sinks:
            self._cluster(self.sinks, n, self.config.prompt_clusters(n - self.sinks))

    def _before_append(self) -> None:
        n = self.layer.held
        if n - self.pending_from >= self.config.cluster_every:
            self._cluster(self.pending_from, n, self.config.new_clusters)

    # ---- the steps
    def _cluster(self, start: int, end: int, k: int) -> None:
        """Cluster slots ``[start, end)`` of every KV head into ``k`` more clusters (the reference's
        ``cluster_tokens``: seeded by the tokens seen) and grow the index with them."""
        lay, cfg = self.layer, self.config
        pool, dev, kv, d = lay.pool, lay.pool.dev, lay.kv_heads, lay.pool.shape.head_dim
        count = end - start
        k = min(k, count)
        picks = initial_picks(cfg.seed + self.seen, kv, count, k, torch.device("cpu")).numpy()
        made = launch_kmeans(dev, pool, lay.read_keys(start, count), kv, count, d, picks, cfg.max_iters)
        sizes = pool.download("cluster sizes", made.sizes, np.int32, (kv, k))
        c0, n0 = self.clusters, self.clustered
        c1, n1 = c0 + k, n0 + count
        centroids, slots = dev.empty(4 * kv * c1 * d), dev.empty(4 * kv * n1)
        append = dev.kernel("clusterkv.cl", "append_rows", {"HEAD_DIM": d, "GROUP": 1})
        i32 = np.int32
        if self.index is not None:
            dev.copy_rect(self.index[0], c0 * d, centroids, c1 * d, 0, kv, c0 * d)
            dev.run(append, (max(n0, 1), kv), None, self.index[3], i32(n0), i32(n0), i32(0), slots, i32(n1), i32(0))
        dev.copy_rect(made.centroids, k * d, centroids, c1 * d, c0 * d, kv, k * d)
        dev.run(append, (count, kv), None, made.order, i32(count), i32(count), i32(start), slots, i32(n1), i32(n0))
        self.sizes = np.concatenate([self.sizes, sizes], axis=1)
        offsets = np.concatenate([np.zeros((kv, 1), np.int32), np.cumsum(self.sizes, axis=1, dtype=np.int32)], axis=1)
        self.index = (centroids, pool.upload("cluster index", self.sizes), pool.upload("cluster index", offsets), slots)
        self.clusters, self.clustered = c1, n1
        self.pending_from = end
        self._bump("clusterings")
        self._bump("kmeans_iterations", made.iterations)

    def _attend_recalled(self, q: np.ndarray) -> np.ndarray:
        """The query over the sinks, the recalled slots and the pending ones: the output ``[Hq, D]``."""
        lay, cfg = self.layer, self.config
        pool, dev, kv, d = lay.pool, lay.pool.dev, lay.kv_heads, lay.pool.shape.head_dim
        q_b = pool.upload("queries", np.ascontiguousarray(q, np.float32))
        budget = max(int(cfg.budget or 0) - self.sinks, 1)
        if self.index is None:
            recalled, counts_b = dev.zeros(4 * kv), dev.zeros(4 * kv)
        else:
            _, recalled, counts_b = launch_recall(dev, q_b, (kv, d, lay.q_heads // kv), self.index, self.clusters,
                                                  self.clustered, budget)  # fmt: skip
        counts = pool.download("recalled counts", counts_b, np.int32, (kv,))
        held = lay.held
        lengths = self.sinks + counts + (held - self.pending_from)
        width = max(int(lengths.max()), 1)
        slot_map, lengths_b = dev.empty(4 * kv * width), dev.empty(4 * kv)
        i32 = np.int32
        build = dev.kernel("clusterkv.cl", "attended_slots", {"HEAD_DIM": d, "GROUP": 1})
        dev.run(build, (width, kv), None, recalled, i32(budget), counts_b, i32(self.sinks), i32(self.pending_from),
                i32(held), slot_map, i32(width), lengths_b)  # fmt: skip
        centroid_bytes = 4 * kv * self.clusters * d
        return lay.attend_slots(q_b, self._scale(d), (slot_map, width), lengths_b, lengths, centroid_bytes)

    def _metadata_bytes(self) -> int:
        """The index: centroids, sizes, offsets and sorted slots."""
        kv, d = self.layer.kv_heads, self.layer.pool.shape.head_dim
        return 4 * kv * (self.clusters * d + 2 * self.clusters + 1 + self.clustered) if self.index else 0
