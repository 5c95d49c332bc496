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

In OpenVINO's GPU plugin (``device="GPU"``) the model stores and attends itself: the prompt is
attended densely (in chunks or whole) and clustered after its last chunk; before a decode step
the tokens due are clustered; the index is copied into the pool's
:class:`~ov_kvcrush.gpu.arena.IndexArena` when it changes, and each decode row's recall
(:meth:`DeviceClusterKVLayerCache.recall_rows`) tells the model's recall layer where it is.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu.clusterkv import launch_kmeans, launch_recall
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache, host_array
from ov_kvcrush.gpu.plugin_layers import RECALL_FIELDS, RECALL_WIDTH
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.slots import StepLogits
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

    # ---- a model that stores and attends itself (our layers in OpenVINO's GPU plugin)
    #: a decode step recalls for one token: a chat's next turn is fed again, as a prompt
    several_tokens_after_prompt = False
    #: the model's layer that recalls for a decode row (:data:`~ov_kvcrush.gpu.plugin_layers.KERNELS`)
    recall_layer: ClassVar[str]
    #: the names of a row's recall, in the layer's order (at most RECALL_WIDTH)
    recall_fields: ClassVar[tuple[str, ...]]

    def reserve(self, t: int) -> None:
        """As the full cache's, with the method's work before a decode token is stored
        (:meth:`_before_model_step`)."""
        if not self.in_prompt and not self.dense_layer:
            if t != 1:
                raise UserError(f"{self.config.name} on device GPU decodes one token per step (a step of {t} came)")
            self._before_model_step()
        super().reserve(t)

    def _before_model_step(self) -> None:
        """Before a decode step's token is stored and recalled for inside the model."""

    def recall_rows(self, token: int | None) -> np.ndarray:
        """Each KV head's recall for the plugin's model (``[kv, RECALL_WIDTH]``, after
        :meth:`reserve`): the step's ``token`` (its index among the step's tokens) recalls
        (:meth:`_recall_fields`); ``None`` (a prompt's step), or a dense layer: the heads attend
        their slots in order (token -1)."""
        rows = np.zeros((self.layer.kv_heads, RECALL_WIDTH), np.int32)
        rows[:, 0] = -1
        if token is None or self.dense_layer:
            return rows
        fields = self._recall_fields(token)
        for i, name in enumerate(self.recall_fields):
            rows[:, i] = fields[name]
        return rows

    def _recall_fields(self, token: int) -> dict[str, Any]:
        """A decode row's recall by field name (an int, or one per KV head)."""
        raise NotImplementedError

    def attended(self) -> int:
        """The most slots a decode row of this layer attends after :meth:`reserve` (its list's
        width): a dense layer's, every one it holds."""
        return self.layer.held if self.dense_layer else self._listed()

    def _listed(self) -> int:
        """The most slots a recalling layer's decode row attends after :meth:`reserve`."""
        raise NotImplementedError

    def candidates(self) -> int:
        """The clusters or pages a decode row of this layer ranks (its scores' width)."""
        return 0


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
        #: the index's copy in the pool's arena for the plugin's model: (first word, words); None: none
        self.published: tuple[int, int] | None = None
        self._index_changed = False  # since it was last copied there
        self._prompt_clustered = False

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
        self._index_changed = True
        self._bump("clusterings")
        self._bump("kmeans_iterations", made.iterations)

    def _attend_recalled(self, q: np.ndarray) -> np.ndarray:
        """The query over the sinks, the recalled slots and the pending ones: the output ``[Hq, D]``."""
        lay = self.layer
        pool, dev, kv, d = lay.pool, lay.pool.dev, lay.kv_heads, lay.pool.shape.head_dim
        q_b = pool.upload("queries", np.ascontiguousarray(q, np.float32))
        budget = self._recall_budget()
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
        return 4 * self._index_words()

    def _index_words(self) -> int:
        return sum(self._index_parts()) if self.index else 0

    def _index_parts(self) -> tuple[int, int, int, int]:
        """The words of the index's parts, in :attr:`index`'s order (and the arena's): the
        centroids [kv, C, D], sizes [kv, C], offsets [kv, C + 1] and sorted slots [kv, N]."""
        kv, c, d = self.layer.kv_heads, self.clusters, self.layer.pool.shape.head_dim
        return kv * c * d, kv * c, kv * (c + 1), kv * self.clustered

    # ---- a model that stores and attends itself (our layers in OpenVINO's GPU plugin)
    recall_layer = "OvkcRecall"
    recall_fields = RECALL_FIELDS

    def _before_model_step(self) -> None:
        self._before_append()  # the tokens due clustered, as _decode_step does

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None) -> None:
        """After the prompt's last chunk: its clusters (:meth:`prefill`'s)."""
        if not self._prompt_clustered and not self._prompt_continues():
            self._after_prefill()
            self._prompt_clustered = True

    def truncate(self, tokens: int) -> bool:
        """As the full cache's where only pending tokens go (the index covers the others); False
        otherwise."""
        return tokens >= self.pending_from and super().truncate(tokens)

    def release(self) -> None:
        self._unpublish()
        super().release()

    def _recall_fields(self, token: int) -> dict[str, Any]:
        """Where the index lies in the arena (copied there first where it changed), per KV head."""
        self._publish()
        kv = self.layer.kv_heads
        base = self.published[0] if self.published else 0
        parts = self._index_parts()
        starts = base + np.cumsum((0, *parts[:-1]))  # each part's first word
        heads = np.arange(kv)
        centroids, sizes, offsets, ordered = (
            start + heads * (words // kv) for start, words in zip(starts, parts, strict=True)
        )
        return dict(token=token, head=heads, clusters=self.clusters, centroids=centroids, sizes=sizes,
                    offsets=offsets, sorted=ordered, clustered=self.clustered, sinks=self.sinks,
                    pending=self.pending_from, budget=self._recall_budget(), held=self.layer.held)  # fmt: skip

    def candidates(self) -> int:
        return self.clusters

    def _listed(self) -> int:
        return self.sinks + min(self._recall_budget(), self.clustered) + self.layer.held - self.pending_from

    def model_step_read(self) -> int:
        """The KV bytes a decode row of the model reads in this layer: the slots it attends, and
        the centroids its query ranks."""
        kv, d = self.layer.kv_heads, self.layer.pool.shape.head_dim
        centroids = 0 if self.dense_layer else 4 * kv * self.clusters * d
        return self._full_precision_read(self.attended()) + centroids

    def _recall_budget(self) -> int:
        return max(int(self.config.budget or 0) - self.sinks, 1)

    def _publish(self) -> None:
        """The index copied into the pool's arena (the centroids, sizes, offsets and sorted slots
        one after another), where it is not there yet."""
        if not self._index_changed:
            return
        self._unpublish()
        self._index_changed = False
        words = self._index_words()
        arena = self.layer.pool.index_arena()
        first = arena.take(words)
        assert self.index is not None
        at = first
        for part, size in zip(self.index, self._index_parts(), strict=True):
            self.layer.pool.dev.copy_bytes(part, arena.buffer, 4 * size, 4 * at)
            at += size
        self.published = (first, words)

    def _unpublish(self) -> None:
        if self.published is not None:
            self.layer.pool.index_arena().give(*self.published)
            self.published = None
