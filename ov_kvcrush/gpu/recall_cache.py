"""ClusterKV's layer cache over the GPU path's device pool: every token held, each decode step
attending the sinks, the clusters its query recalls and the tokens not clustered yet.

The steps are the reference's (:class:`~ov_kvcrush.methods.clusterkv.ClusterKVLayerCache`), on
the device: the prompt's keys past the sinks clustered by cosine k-means from the reference's
seeded picks, every ``cluster_every`` generated tokens clustered into ``new_clusters`` more, each
clustering one launch a layer (``kmeans.cl``: the keys read from the pool in place, the picks
drawn there, the clusters added to the index where it lies in the pool's
:class:`~ov_kvcrush.gpu.arena.IndexArena`); per step the centroids ranked by the query, whole
clusters recalled up to the budget, and the list of slots attended built there. Nothing of a
clustering crosses to the host (the k-means iterations are read when the counters are); per
decode step on the torch path the recalled count per KV head does. The recall cache's hit
counters are the reference's alone (they are statistics, and would need the chosen clusters on
the host).

In OpenVINO's GPU plugin (``device="GPU"``) the model stores and attends itself: the prompt is
attended densely (in chunks or whole) and clustered after its last chunk; before a decode step
the tokens due are clustered; each decode row's recall
(:meth:`DeviceClusterKVLayerCache.recall_rows`) tells the model's recall layer where the index
lies in the arena.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu.clusterkv import Clustering, IndexRun, StepClustering, launch_clustering, launch_recall
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache, host_array
from ov_kvcrush.gpu.layer_inputs import RECALL_FIELDS, RECALL_WIDTH
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.methods import MethodConfig
from ov_kvcrush.methods.clusterkv import ClusterKVConfig


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
    """ClusterKV over the device pool, its index in the pool's :class:`~ov_kvcrush.gpu.arena.IndexArena`."""

    config: ClusterKVConfig

    def __init__(self, config: ClusterKVConfig, pool: DevicePool, kv_heads: int, q_heads: int, dense: bool) -> None:
        super().__init__(config, pool, kv_heads, q_heads, dense)
        self.sinks = 0
        self.pending_from = 0  # slots >= this are generated tokens not clustered yet
        self.clusters = 0  # C: clusters per KV head
        self.clustered = 0  # N: slots clustered per KV head
        #: where the index lies in the arena (None: no clustering yet)
        self.run: IndexRun | None = None
        #: each clustering's per-head k-means iterations (a buffer and the head 0's int in it), on
        #: the device until the counters are read
        self._iterations_unread: list[tuple[Any, int]] = []
        #: the clustering due before the model's step, launched with the step's other sequences'
        self._due: StepClustering | None = None
        self._prompt_clustered = False

    @property
    def counters(self) -> dict[str, float]:
        """The method's counters, the k-means iterations read now from the clusterings since the
        last read (as the reference counts them: the most any head ran, summed over clusterings)."""
        if self._iterations_unread:
            kv, pool = self.layer.kv_heads, self.layer.pool
            unread = self._iterations_unread
            heads = (pool.download("k-means iterations", b, np.int32, (at + kv,))[at:] for b, at in unread)
            ran = sum(int(ran.max()) for ran in heads)
            self._iterations_unread = []
            self._counters["kmeans_iterations"] = self._counters.get("kmeans_iterations", 0) + ran
        return self._counters

    @counters.setter
    def counters(self, value: dict[str, float]) -> None:
        self._counters = value

    def _bump(self, key: str, amount: float = 1) -> None:
        """As the base's, without reading the iterations (a step counts, it does not wait)."""
        self._counters[key] = self._counters.get(key, 0) + amount

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
        """Cluster slots ``[start, end)`` of every KV head into ``k`` more clusters, added to the
        index where it lies: one launch, now."""
        lay, pool = self.layer, self.layer.pool
        due = self._take_clustering(start, end, k)
        tables, stride = lay.device_tables()
        index = (pool.index_arena().buffer, due.held, due.run)
        _, _, iterations = launch_clustering(pool.dev, pool.shape, (pool.buffer, tables, stride), due.what,
                                             due.seeding, index)  # fmt: skip
        self.clustering_enqueued(due, (iterations, 0))

    def _take_clustering(self, start: int, end: int, k: int) -> StepClustering:
        """The clustering of slots ``[start, end)`` of every KV head into ``k`` more clusters (the
        reference's ``cluster_tokens``: seeded by the tokens seen), the index's counts as they
        will be once it has run, a run with room for them taken where the held one has none;
        launched by the caller, who then calls :meth:`clustering_enqueued`."""
        cfg = self.config
        count = end - start
        what = Clustering(start, count, min(k, count), self.clusters, self.clustered)
        held = self.run
        run = self._run_for(what.clusters + what.k, what.slots + count, what.k, count)
        self.clusters, self.clustered = what.clusters + what.k, what.slots + count
        self.pending_from = end
        return StepClustering(what, held or run, run, (cfg.seed + self.seen, cfg.max_iters))

    def clustering_enqueued(self, due: StepClustering, iterations: tuple[Any, int]) -> None:
        """After ``due``'s launch is enqueued: the run it moved from back to the arena (the
        in-order queue moves it before the words are reused), its heads' iteration counts
        (``iterations``: the buffer and head 0's int in it) read with the counters."""
        if due.held != due.run:
            self.layer.pool.index_arena().give(due.held.first, due.held.words)
        self._iterations_unread.append(iterations)
        self._bump("clusterings")

    def _run_for(self, clusters: int, slots: int, k: int, count: int) -> IndexRun:
        """The run the index lies in once it holds ``clusters`` clusters over ``slots`` slots: the
        one it is in where that has room, else a new one with room for four more clusterings of
        ``k`` clusters over ``count`` slots (or a quarter more)."""
        if self.run is not None and self.run.holds(clusters, slots):
            return self.run
        lay = self.layer
        rooms = (max(clusters + 4 * k, clusters * 5 // 4), max(slots + 4 * count, slots * 5 // 4))
        words = IndexRun(0, lay.kv_heads, lay.pool.shape.head_dim, *rooms).words
        self.run = IndexRun(lay.pool.index_arena().take(words), lay.kv_heads, lay.pool.shape.head_dim, *rooms)
        return self.run

    def _attend_recalled(self, q: np.ndarray) -> np.ndarray:
        """The query over the sinks, the recalled slots and the pending ones: the output ``[Hq, D]``."""
        lay = self.layer
        pool, dev, kv, d = lay.pool, lay.pool.dev, lay.kv_heads, lay.pool.shape.head_dim
        q_b = pool.upload("queries", np.ascontiguousarray(q, np.float32))
        budget = self._recall_budget()
        if self.run is None:
            recalled, counts_b = dev.zeros(4 * kv), dev.zeros(4 * kv)
        else:
            index = (pool.index_arena().buffer, self.run)
            _, recalled, counts_b = launch_recall(dev, q_b, lay.q_heads // kv, index, self.clusters, budget)
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
        return sum(self._index_parts()) if self.run else 0

    def _index_parts(self) -> tuple[int, int, int, int]:
        """The words of the index's parts, in its run's order (:class:`IndexRun`): the
        centroids [kv, C, D], sizes [kv, C], offsets [kv, C + 1] and sorted slots [kv, N] (the
        words held: the run's rooms past them are not counted)."""
        kv, c, d = self.layer.kv_heads, self.clusters, self.layer.pool.shape.head_dim
        return kv * c * d, kv * c, kv * (c + 1), kv * self.clustered

    # ---- a model that stores and attends itself (our layers in OpenVINO's GPU plugin)
    recall_layer = "OvkcRecall"
    recall_fields = RECALL_FIELDS

    def _before_model_step(self) -> None:
        """The tokens due clustered, as :meth:`_decode_step` does, launched with the step's other
        sequences' (:meth:`take_step_clustering`)."""
        n = self.layer.held
        if n - self.pending_from >= self.config.cluster_every:
            self._due = self._take_clustering(self.pending_from, n, self.config.new_clusters)

    def take_step_clustering(self) -> StepClustering | None:
        due, self._due = self._due, None
        return due

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """After the prompt's last chunk: its clusters (:meth:`prefill`'s)."""
        if not self._prompt_clustered and not self._prompt_continues():
            self._after_prefill()
            self._prompt_clustered = True

    def truncate(self, tokens: int) -> bool:
        """As the full cache's where only pending tokens go (the index covers the others); False
        otherwise."""
        return tokens >= self.pending_from and super().truncate(tokens)

    def release(self) -> None:
        if self.run is not None:
            self.layer.pool.index_arena().give(self.run.first, self.run.words)
            self.run = None
        super().release()

    def _recall_fields(self, token: int) -> dict[str, Any]:
        """Where the index lies in the arena, per KV head."""
        heads = np.arange(self.layer.kv_heads)
        none = np.zeros_like(heads)
        centroids, sizes, offsets, ordered = self.run.head_starts() if self.run else (none, none, none, none)
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
