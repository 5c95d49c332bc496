"""ClusterKV on the GPU path (``plugins/gpu/kernels/kmeans.cl``, ``clusterkv.cl``), step for step
as the reference (:mod:`ov_kvcrush.methods.clusterkv`): cosine k-means over each KV head's keys
from the reference's seeded initial picks and the cluster index (sizes, prefix offsets, the
tokens sorted by label), in one launch per layer that adds to the index in place; and each
decode step's centroid ranking and recalled slots.

The index lies in an arena of int32 words (:class:`IndexRun`), where the GPU plugin's model reads
it too. Nothing of a clustering crosses to the host: each head's k-means iteration count is
written on the device and read only when the counters are asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import KernelDevice, Transfers, device, kernel_define
from ov_kvcrush.gpu.layout import PoolShape, page_heads
from ov_kvcrush.gpu.store import store_constants
from ov_kvcrush.validation import check_int

#: the work-group of a clustering (one per KV head): ``kmeans.cl``'s LANES, a power of two
CLUSTER_LANES = 64


def _kernel(dev: KernelDevice, name: str, head_dim: int, group: int = 1) -> Any:
    return dev.kernel("clusterkv.cl", name, {"HEAD_DIM": head_dim, "GROUP": group})


@dataclass(frozen=True)
class IndexRun:
    """Where one layer's cluster index lies in an arena of int32 words: the centroids (floats,
    ``[kv, cluster_room, D]``), sizes ``[kv, cluster_room]``, offsets ``[kv, cluster_room + 1]``
    and the slots sorted by cluster ``[kv, slot_room]``, part after part from word ``first``. The
    rooms past the clusters and slots held let a clustering add to the index where it lies."""

    first: int
    kv: int
    head_dim: int
    cluster_room: int
    slot_room: int

    @property
    def strides(self) -> tuple[int, int, int, int]:
        """Each part's words from one KV head to the next."""
        c = self.cluster_room
        return c * self.head_dim, c, c + 1, self.slot_room

    @property
    def starts(self) -> tuple[int, int, int, int]:
        """Each part's first word (its head 0)."""
        at, out = self.first, []
        for stride in self.strides:
            out.append(at)
            at += self.kv * stride
        return out[0], out[1], out[2], out[3]

    @property
    def words(self) -> int:
        return self.kv * sum(self.strides)

    def holds(self, clusters: int, slots: int) -> bool:
        return clusters <= self.cluster_room and slots <= self.slot_room

    def head_starts(self) -> tuple[np.ndarray, ...]:
        """Each part's first word for each KV head: the recall layer's row fields."""
        heads = np.arange(self.kv)
        return tuple(start + heads * stride for start, stride in zip(self.starts, self.strides, strict=True))

    def args(self) -> list[np.int32]:
        """The run as ``kmeans.cl``'s RUN_ARGS: the parts' first words, then their strides."""
        return [np.int32(v) for v in (*self.starts, *self.strides)]


@dataclass
class Clustering:
    """What one clustering launch adds to the index: the run of slots ``[first, first + n)``
    into ``k`` clusters, after the ``clusters`` clusters over ``slots`` slots held."""

    first: int
    n: int
    k: int
    clusters: int
    slots: int


def launch_clustering(
    dev: KernelDevice,
    shape: PoolShape,
    heads: tuple[Any, Any, int],
    what: Clustering,
    seeding: tuple[int, int],
    index: tuple[Any, IndexRun, IndexRun],
) -> tuple[Any, Any, Any]:
    """Enqueue the clustering of ``what`` for every KV head of the pool's ``heads`` (the pool's
    buffer, block tables and their stride): k-means from the picks seeded by ``seeding`` (seed,
    iteration cap), its clusters added to the index in the arena buffer ``index[0]`` (moved from
    run ``index[1]`` to run ``index[2]`` first where they differ). Returns the device buffers of
    the labels ``[kv, n]``, the scratch (each head's ``[n + 2k, D]``: the normalised keys, then the
    last directions) and each head's iteration count ``[kv]``."""
    pool, tables, table_stride = heads
    arena, held, run = index
    seed, max_iters = seeding
    kv, d, n, k = run.kv, shape.head_dim, what.n, what.k
    labels, scratch, iterations = dev.empty(4 * kv * n), dev.empty(4 * kv * (n + 2 * k) * d), dev.empty(4 * kv)
    kernel = dev.kernel("kmeans.cl", "cluster_slots", {**store_constants(shape), "LANES": CLUSTER_LANES})
    i32 = np.int32
    dev.run(kernel, (CLUSTER_LANES, kv), (CLUSTER_LANES, 1), pool, tables, i32(table_stride), i32(what.first), i32(n),
            i32(k), np.uint32(seed & 0xFFFFFFFF), i32(max_iters), scratch, labels, arena, *held.args(), *run.args(),
            i32(what.clusters), i32(what.slots), iterations)  # fmt: skip
    return labels, scratch, iterations


@dataclass(frozen=True)
class StepClustering:
    """One sequence's clustering due before a decode step, in one layer: ``what`` added to the
    index held in run ``held`` and written in run ``run`` (the same where it has room), seeded by
    ``seeding`` (seed, iteration cap); launched with the step's other sequences'
    (:func:`launch_step_clusterings`)."""

    what: Clustering
    held: IndexRun
    run: IndexRun
    seeding: tuple[int, int]

    def row(self, scratch_at: int, labels_at: int, sequence: int) -> list[int]:
        """Its ``kmeans.cl`` ``C_*`` ints, its scratch and labels from those words on (``sequence``:
        its place among the step's)."""
        w, (seed, max_iters) = self.what, self.seeding
        seed_bits = int(np.array(seed & 0xFFFFFFFF, np.uint32).view(np.int32))
        return [w.first, w.n, w.k, seed_bits, max_iters, w.clusters, w.slots, *map(int, self.held.args()),
                *map(int, self.run.args()), scratch_at, labels_at, sequence]  # fmt: skip


@cache
def clustering_fields() -> int:
    """The ints of a sequence's row of ``step_cluster_slots`` (``kmeans.cl``'s ``C_FIELDS``: the
    one copy of that layout, which :meth:`StepClustering.row` follows)."""
    return kernel_define("kmeans.cl", "C_FIELDS")


def launch_step_clusterings(
    dev: KernelDevice, io: Transfers, shape: PoolShape, tables: tuple[Any, Any, int, int], arena: Any,
    due: list[StepClustering | None],
) -> Any:  # fmt: skip
    """Enqueue the clusterings ``due`` (``due[s]``: sequence ``s``'s, None where it has none) in
    one launch (``kmeans.cl``'s ``step_cluster_slots``, a row of work a clustering): ``tables``
    is the pool's buffer, the step's block tables, the layer's first row among them (a row per
    sequence and KV head) and their stride; the index lies in the arena buffer ``arena``.
    Returns each head's iteration count, ``[sequences, kv]`` on the device."""
    pool, table_buffer, first_row, table_stride = tables
    todo = [(s, c) for s, c in enumerate(due) if c is not None]
    kv, d = todo[0][1].run.kv, shape.head_dim
    rows = np.zeros((len(todo), clustering_fields()), np.int32)
    scratch_at = labels_at = 0
    for i, (s, c) in enumerate(todo):
        rows[i] = c.row(scratch_at, labels_at, s)
        scratch_at += kv * (c.what.n + 2 * c.what.k) * d
        labels_at += kv * c.what.n
    scratch, labels, iterations = dev.empty(4 * scratch_at), dev.empty(4 * labels_at), dev.empty(4 * len(due) * kv)
    kernel = dev.kernel("kmeans.cl", "step_cluster_slots", {**store_constants(shape), "LANES": CLUSTER_LANES})
    i32 = np.int32
    dev.run(kernel, (CLUSTER_LANES, kv, len(todo)), (CLUSTER_LANES, 1, 1), pool, table_buffer, i32(first_row),
            i32(table_stride), io.upload("clusterings", rows), scratch, labels, arena, iterations)  # fmt: skip
    return iterations


@dataclass
class GPUClusters:
    """One clustering of ``rows`` heads' ``n`` tokens into ``k`` clusters, read back."""

    labels: np.ndarray  # [rows, n]
    directions: np.ndarray  # [rows, k, D] unit directions the last assignment used
    centroids: np.ndarray  # [rows, k, D] plain means of the members' keys
    sizes: np.ndarray  # [rows, k]
    offsets: np.ndarray  # [rows, k + 1]
    sorted_tokens: np.ndarray  # [rows, n] slots sorted by label, ties by slot
    iterations: int  # the most any head ran (the reference iterates a batch until every row converged)


def kmeans_cosine(
    x: np.ndarray, k: int, max_iters: int, first_slot: int = 0, sub_group: int | None = None, seed: int = 0
) -> GPUClusters:
    """Spherical k-means of ``x`` ``[rows, n, D]`` (laid out in an f32 pool as slots ``first_slot
    ..`` of each head) into ``min(k, n)`` clusters from the reference's ``initial_picks(seed)``:
    assign by largest cosine (the first on ties), stop when no label moved, else move each
    direction to its members' normalised sum; then the index of those slots."""
    check_int("max_iters", max_iters, 1, 10_000)
    dev = device(None if sub_group is None else sub_group)
    rows, n, d = x.shape
    k = min(k, n)
    shape = PoolShape("f32", 16, d)
    rng = np.random.default_rng(n)
    ahead = rng.standard_normal((rows, first_slot, d)).astype(np.float32)  # slots before the run
    keys = [np.concatenate([ahead[r], x[r]]).astype(np.float32) for r in range(rows)]
    paged = page_heads(shape, keys, keys, rng)
    run = IndexRun(0, rows, d, k, n)
    arena = dev.zeros(4 * run.words)
    heads = (dev.to_device(paged.pool), dev.to_device(paged.tables), paged.tables.shape[1])
    labels, scratch, iterations = launch_clustering(
        dev, shape, heads, Clustering(first_slot, n, k, 0, 0), (seed, max_iters), (arena, run, run)
    )
    words = dev.to_host(arena, np.int32, (run.words,))
    c, s, o, t = (words[a : a + rows * w].reshape(rows, w) for a, w in zip(run.starts, run.strides, strict=True))
    return GPUClusters(
        labels=dev.to_host(labels, np.int32, (rows, n)),
        directions=dev.to_host(scratch, np.float32, (rows, n + 2 * k, d))[:, n : n + k],
        centroids=c.view(np.float32).reshape(rows, k, d),
        sizes=s.copy(),
        offsets=o.copy(),
        sorted_tokens=t.copy(),
        iterations=int(dev.to_host(iterations, np.int32, (rows,)).max()),
    )


def launch_recall(
    dev: KernelDevice, q: Any, group: int, index: tuple[Any, IndexRun], clusters: int, budget: int
) -> tuple[Any, Any, Any]:
    """Enqueue one decode step's recall for device query ``q`` ``[Hq, D]`` (``group`` query heads
    a KV head) over the ``clusters`` clusters of the index in run ``index[1]`` of the arena buffer
    ``index[0]``. Returns the device cluster order ``[kv, C]``, recalled slots ``[kv, budget]`` and
    their counts ``[kv]``."""
    arena, run = index
    kv, d = run.kv, run.head_dim
    (c_at, s_at, o_at, t_at), (c_stride, s_stride, o_stride, t_stride) = run.starts, run.strides
    i32 = np.int32
    scores = dev.empty(4 * kv * max(clusters, 1))
    dev.run(_kernel(dev, "centroid_scores", d, group), (clusters, kv), None, q, arena, i32(c_at), i32(c_stride),
            i32(clusters), scores)  # fmt: skip
    order = dev.empty(4 * kv * max(clusters, 1))
    dev.run(_kernel(dev, "rank_order", d, group), (clusters, kv), None, scores, i32(clusters), order)
    slots, counts = dev.empty(4 * kv * max(budget, 1)), dev.empty(4 * kv)
    dev.run(_kernel(dev, "recall_slots", d, group), (dev.sub_group, kv), (dev.sub_group, 1), order, arena, i32(s_at),
            i32(s_stride), i32(o_at), i32(o_stride), i32(t_at), i32(t_stride), i32(clusters), i32(budget), slots,
            counts)  # fmt: skip
    return order, slots, counts


def recall(
    q: np.ndarray, clusters: GPUClusters, budget: int, sub_group: int | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One decode step's recall for query ``q`` ``[Hq, D]`` over each KV head's clusters: the
    cluster order per head (best first: ``q . centroid`` summed over the query group, ties to the
    lower id) and the recalled slots (whole clusters in that order up to ``budget``, the last one
    trimmed to its earliest tokens)."""
    check_int("budget", budget, 0, 1 << 30)
    dev = device(sub_group)
    kv, c, d = clusters.centroids.shape
    run = IndexRun(3, kv, d, c + 2, clusters.sorted_tokens.shape[1] + 5)  # rooms past what is held, as grown
    words = np.full(run.first + run.words, -7, np.int32)
    parts = (clusters.centroids.view(np.int32), clusters.sizes, clusters.offsets, clusters.sorted_tokens)
    for part, start, stride in zip(parts, run.starts, run.strides, strict=True):
        rows = part.reshape(kv, -1).astype(np.int32)
        for h in range(kv):
            words[start + h * stride : start + h * stride + rows.shape[1]] = rows[h]
    index = (dev.to_device(words), run)
    order, slots, counts = launch_recall(dev, dev.to_device(q.astype(np.float32)), q.shape[0] // kv, index, c, budget)
    taken = dev.to_host(counts, np.int32, (kv,))
    picked = dev.to_host(slots, np.int32, (kv, max(budget, 1)))
    return dev.to_host(order, np.int32, (kv, c)), [picked[h, : taken[h]] for h in range(kv)]
