"""ClusterKV on the GPU path (``plugins/gpu/kernels/clusterkv.cl``), step for step as the
reference (:mod:`ov_kvcrush.methods.clusterkv`): cosine k-means over each KV head's keys from
the reference's seeded initial picks, the cluster index (sizes, prefix offsets, the tokens sorted
by label), and each decode step's centroid ranking and recalled slots.

What crosses to the host: one int per k-means iteration (did a label move?), and per decode step
the recalled slot count per head (the slots stay on the device for the attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import DirectTransfers, KernelDevice, Transfers, device
from ov_kvcrush.gpu.sort import stable_order
from ov_kvcrush.validation import check_int


@dataclass
class GPUClusters:
    """One clustering of ``rows`` heads' ``n`` tokens into ``k`` clusters, read back."""

    labels: np.ndarray  # [rows, n]
    directions: np.ndarray  # [rows, k, D] unit directions the last assignment used
    centroids: np.ndarray  # [rows, k, D] plain means of the members' keys
    sizes: np.ndarray  # [rows, k]
    offsets: np.ndarray  # [rows, k + 1]
    sorted_tokens: np.ndarray  # [rows, n] slots sorted by label, ties by slot
    iterations: int


def _kernel(dev: KernelDevice, name: str, head_dim: int, group: int = 1) -> Any:
    return dev.kernel("clusterkv.cl", name, {"HEAD_DIM": head_dim, "GROUP": group})


@dataclass
class ClustersOnDevice:
    """One clustering's device buffers: labels ``[rows, n]``, directions and centroids ``[rows, k,
    D]``, sizes ``[rows, k]``, the slots sorted by label ``[rows, n]`` (counting from 0)."""

    labels: Any
    directions: Any
    centroids: Any
    sizes: Any
    order: Any
    iterations: int


def launch_kmeans(
    dev: KernelDevice, io: Transfers, x: Any, rows: int, n: int, d: int, picks: np.ndarray, max_iters: int
) -> ClustersOnDevice:
    """Spherical k-means of device ``x`` ``[rows, n, D]`` from the initial ``picks`` ``[rows, k]``;
    one int crosses per iteration (did a label move?)."""
    k = picks.shape[1]
    i32 = np.int32
    xn_b = dev.empty(4 * rows * n * d)
    dev.run(_kernel(dev, "normalize_rows", d), (dev.sub_group, n, rows), (dev.sub_group, 1, 1), x, xn_b)
    directions = dev.empty(4 * rows * k * d)
    dev.run(_kernel(dev, "gather_picks", d), (d, k, rows), None, xn_b, i32(n),
            io.upload("k-means picks", picks.astype(np.int32)), directions)  # fmt: skip
    labels = dev.to_device(np.full((rows, n), -1, np.int32))  # (filled on the device in a real host)
    changed = dev.empty(4)
    means, sizes = dev.empty(4 * rows * k * d), dev.empty(4 * rows * k)
    iterations = 0

    def update(final_step: int) -> None:  # directions to the members' normalised sums, or (final) the means
        dev.run(_kernel(dev, "update_directions", d), (k, rows), None, xn_b, x, i32(n), labels, directions, means,
                sizes, i32(final_step))  # fmt: skip

    while iterations < max_iters:
        iterations += 1
        dev.clear(changed, 4)
        dev.run(_kernel(dev, "assign_nearest", d), (n, rows), None, xn_b, directions, i32(k), labels, changed)
        if not io.download("k-means convergence", changed, np.int32, (1,))[0]:
            break
        update(0)
    update(1)
    return ClustersOnDevice(labels, directions, means, sizes, stable_order(dev, labels, n, k, rows), iterations)


def kmeans_cosine(
    x: np.ndarray, picks: np.ndarray, max_iters: int, first_slot: int = 0, sub_group: int | None = None
) -> GPUClusters:
    """Spherical k-means of ``x`` ``[rows, n, D]`` from the initial ``picks`` ``[rows, k]`` (the
    reference's ``initial_picks``): assign by largest cosine (the first on ties), stop when no
    label moved, else move each direction to its members' normalised sum; then the index of the
    slots ``first_slot + i``."""
    check_int("max_iters", max_iters, 1, 10_000)
    dev = device(None if sub_group is None else sub_group)
    rows, n, d = x.shape
    k = picks.shape[1]
    c = launch_kmeans(dev, DirectTransfers(dev), dev.to_device(x.astype(np.float32)), rows, n, d, picks, max_iters)
    size = dev.to_host(c.sizes, np.int32, (rows, k))
    return GPUClusters(
        labels=dev.to_host(c.labels, np.int32, (rows, n)),
        directions=dev.to_host(c.directions, np.float32, (rows, k, d)),
        centroids=dev.to_host(c.centroids, np.float32, (rows, k, d)),
        sizes=size,
        offsets=np.concatenate([np.zeros((rows, 1), np.int32), np.cumsum(size, axis=1, dtype=np.int32)], axis=1),
        sorted_tokens=dev.to_host(c.order, np.int32, (rows, n)) + first_slot,
        iterations=c.iterations,
    )


def launch_recall(
    dev: KernelDevice,
    q: Any,
    heads: tuple[int, int, int],
    index: tuple[Any, Any, Any, Any],
    clusters: int,
    clustered: int,
    budget: int,
) -> tuple[Any, Any, Any]:
    """Enqueue one decode step's recall for device query ``q`` ``[Hq, D]``: ``heads`` (KV heads,
    head size, query group), ``index`` the device centroids ``[kv, C, D]``, sizes ``[kv, C]``, offsets ``[kv,
    C + 1]`` and sorted slots ``[kv, N]``. Returns the device cluster order ``[kv, C]``, recalled
    slots ``[kv, budget]`` and their counts ``[kv]``."""
    kv, d, group = heads
    centroids, sizes, offsets, sorted_tokens = index
    i32 = np.int32
    scores = dev.empty(4 * kv * max(clusters, 1))
    dev.run(_kernel(dev, "centroid_scores", d, group), (clusters, kv), None, q, centroids, i32(clusters), scores)
    order = dev.empty(4 * kv * max(clusters, 1))
    dev.run(_kernel(dev, "rank_order", d, group), (clusters, kv), None, scores, i32(clusters), order)
    slots, counts = dev.empty(4 * kv * max(budget, 1)), dev.empty(4 * kv)
    dev.run(_kernel(dev, "recall_slots", d, group), (dev.sub_group, kv), (dev.sub_group, 1), order, sizes, offsets,
            sorted_tokens, i32(clusters), i32(clustered), i32(budget), slots, counts)  # fmt: skip
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
    n = clusters.sorted_tokens.shape[1]
    index = (
        dev.to_device(clusters.centroids),
        dev.to_device(clusters.sizes),
        dev.to_device(clusters.offsets.astype(np.int32)),
        dev.to_device(clusters.sorted_tokens.astype(np.int32)),
    )
    heads = (kv, d, q.shape[0] // kv)
    order, slots, counts = launch_recall(dev, dev.to_device(q.astype(np.float32)), heads, index, c, n, budget)
    taken = dev.to_host(counts, np.int32, (kv,))
    picked = dev.to_host(slots, np.int32, (kv, max(budget, 1)))
    return dev.to_host(order, np.int32, (kv, c)), [picked[h, : taken[h]] for h in range(kv)]
