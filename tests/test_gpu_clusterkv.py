"""ClusterKV on the GPU path (issue 49) on Intel's OpenCL CPU runtime, at sub-group sizes 8 and
16, against the reference (``methods.clusterkv``): k-means' labels, sizes, iteration count and
the index's sorted tokens and offsets equal, centroids and directions within float rounding; each
decode step's cluster order and recalled slots equal. The kernels run in the ``gpu_worker``
process (conftest); without Intel's runtime the tests skip, naming what is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_kvcrush.gpu import clusterkv
from ov_kvcrush.methods import clusterkv as reference

SUB_GROUPS = (8, 16)


def clustered_keys(rng: np.random.Generator, rows: int, n: int, d: int, centers: int, noise: float) -> np.ndarray:
    c = rng.standard_normal((rows, centers, d))
    return (c[:, rng.integers(0, centers, n)] + noise * rng.standard_normal((rows, n, d))).astype(np.float32)


CASES = [
    # rows, n, d, k, noise, max_iters, seed: converging; capped before converging (noise only); k >
    # n's natural clusters, some emptied; Llama's head size; more than a work-group's vectors
    (3, 200, 64, 12, 0.5, 10, 0),
    (3, 300, 64, 20, 10.0, 3, 7),
    (2, 64, 64, 40, 0.1, 10, 2**32 + 5),
    (2, 150, 128, 8, 0.5, 10, 1234),
    (1, 9, 64, 9, 0.5, 10, 3),
]


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize(("rows", "n", "d", "k", "noise", "max_iters", "seed"), CASES)
def test_kmeans_and_recall_equal_the_reference(gpu_worker, rows, n, d, k, noise, max_iters, seed, sub_group):
    """One launch a layer: the picks drawn on the device from the seed (a seed past 2**32 too:
    its low 32 bits, as the reference's), k-means run per head to its own convergence (the
    reference's count is the batch's most), the index written in its run of the arena."""
    rng = np.random.default_rng(n + k + sub_group)
    x = clustered_keys(rng, rows, n, d, 5, noise)
    km = reference.kmeans_cosine(torch.from_numpy(x), k, max_iters=max_iters, seed=seed)
    got = gpu_worker.submit(clusterkv.kmeans_cosine, x, k, max_iters, 16, sub_group, seed).result()
    assert got.iterations == km.iterations
    np.testing.assert_array_equal(got.labels, km.labels.numpy())
    np.testing.assert_array_equal(got.sizes, km.sizes.numpy())
    np.testing.assert_allclose(got.centroids, km.centroids.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.directions, km.directions.numpy(), rtol=1e-5, atol=1e-6)
    index = reference.ClusterIndex.build(km.centroids, km.labels, torch.arange(16, 16 + n))
    np.testing.assert_array_equal(got.sorted_tokens, index.sorted_tokens.numpy())
    np.testing.assert_array_equal(got.offsets, index.offsets.numpy())
    group = 3
    for budget in (0, 50, n // 2, n + 10):
        q = rng.standard_normal((rows * group, d), dtype=np.float32)
        order_ref = reference.rank_clusters(torch.from_numpy(q)[None, :, None], km.centroids, rows)
        slots_ref, _ids = reference.select_clusters(index, order_ref, budget)
        order, slots = gpu_worker.submit(clusterkv.recall, q, got, budget, sub_group).result()
        np.testing.assert_array_equal(order, order_ref.numpy())
        for h in range(rows):
            np.testing.assert_array_equal(slots[h], slots_ref[h].numpy())


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
def test_a_decode_step_attends_the_sinks_recalled_and_pending_slots(gpu_worker, sub_group):
    """ClusterKV's step (``ClusterKVLayerCache._select``): the sinks, the recalled clusters'
    slots and the generated tokens not clustered yet, attended through the decode kernel's slot
    list; the output is the reference attention over exactly those tokens."""
    from ov_kvcrush.gpu import attention, layout

    rng = np.random.default_rng(5 + sub_group)
    kv, group, d, sinks, clustered, pending = 2, 3, 64, 4, 150, 7
    n = sinks + clustered + pending
    keys = clustered_keys(rng, kv, n, d, 6, 0.5)
    values = rng.standard_normal((kv, n, d), dtype=np.float32)
    clusters = gpu_worker.submit(
        clusterkv.kmeans_cosine, keys[:, sinks : sinks + clustered], 10, 10, sinks, sub_group
    ).result()
    q = rng.standard_normal((kv * group, d), dtype=np.float32)
    _order, recalled = gpu_worker.submit(clusterkv.recall, q, clusters, 40, sub_group).result()
    attended = [np.concatenate([np.arange(sinks), r, np.arange(sinks + clustered, n)]) for r in recalled]
    shape = layout.PoolShape("f32", 32, d, group=group)
    paged = layout.page_heads(shape, list(keys), list(values), rng)
    out, probs = gpu_worker.submit(
        attention.paged_decode, shape, paged.pool, paged.tables, paged.lengths, q, d**-0.5, sub_group, None, attended
    ).result()
    for h in range(kv * group):
        slots = attended[h // group]
        assert len(slots) == sinks + 40 + pending
        s = keys[h // group, slots] @ q[h] * d**-0.5
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(out[h], p @ values[h // group, slots], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(probs[h, : len(slots)], p, rtol=1e-5, atol=1e-7)


def _step_and_alone(keys: np.ndarray, kv: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Three sequences' keys ``[3 * kv, n, D]`` in one f32 pool (a row per sequence and KV head,
    as a step's block tables): the first's slots 4.. clustered into 6 clusters; the third's index
    held (its slots 0..40 in 5 clusters, clustered alone first), then its slots 40.. into 4 more,
    moved to a larger run; the second none. Once as the step's one launch, once each alone:
    each run's arena words and the two clusterings' iteration counts ``[2, kv]``."""
    from ov_kvcrush.gpu.device import DirectTransfers, device
    from ov_kvcrush.gpu.layout import PoolShape, page_heads

    dev = device(16)
    n, d = keys.shape[1], keys.shape[2]
    shape = PoolShape("f32", 16, d)
    paged = page_heads(shape, list(keys), list(keys), np.random.default_rng(1))
    pool, tables, stride = dev.to_device(paged.pool), dev.to_device(paged.tables), paged.tables.shape[1]
    first = clusterkv.IndexRun(0, kv, d, 6, n)
    held = clusterkv.IndexRun(first.words, kv, d, 5, 40)
    moved = clusterkv.IndexRun(held.first + held.words, kv, d, 12, n)
    words = moved.first + moved.words

    def heads(s: int) -> tuple:
        return pool, dev.to_device(np.ascontiguousarray(paged.tables[s * kv : (s + 1) * kv])), stride

    due = [
        clusterkv.StepClustering(clusterkv.Clustering(4, n - 4, 6, 0, 0), first, first, (3, 10)),
        None,
        clusterkv.StepClustering(clusterkv.Clustering(40, n - 40, 4, 5, 40), held, moved, (2**32 + 11, 10)),
    ]
    out = []
    for together in (True, False):
        arena = dev.zeros(4 * words)
        clusterkv.launch_clustering(dev, shape, heads(2), clusterkv.Clustering(0, 40, 5, 0, 0), (9, 10),
                                    (arena, held, held))  # fmt: skip
        if together:
            its = clusterkv.launch_step_clusterings(dev, DirectTransfers(dev), shape, (pool, tables, 0, stride), arena,
                                                    due)  # fmt: skip
            iterations = dev.to_host(its, np.int32, (3, kv))[[0, 2]]
        else:
            alone = [clusterkv.launch_clustering(dev, shape, heads(s), c.what, c.seeding, (arena, c.held, c.run))[2]
                     for s, c in enumerate(due) if c is not None]  # fmt: skip
            iterations = np.stack([dev.to_host(b, np.int32, (kv,)) for b in alone])
        out.append((dev.to_host(arena, np.int32, (words,)), iterations))
    return out


def test_a_steps_clusterings_in_one_launch_equal_each_sequences_own(gpu_worker):
    """A decode step's clusterings of several sequences in one launch (``step_cluster_slots``: a
    row of work a clustering, the keys read through the step's block tables, a sequence between
    without one) write each index exactly as each sequence's own launch does (checked against the
    reference above): a new index, and a held one moved to a larger run and grown, with the same
    iteration counts."""
    rng = np.random.default_rng(23)
    kv, n, d = 2, 120, 64
    keys = clustered_keys(rng, 3 * kv, n, d, 5, 0.5)
    (together, its_together), (alone, its_alone) = gpu_worker.submit(_step_and_alone, keys, kv).result()
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(its_together, its_alone)
    first = clusterkv.IndexRun(0, kv, d, 6, n)
    sizes = together[first.starts[1] : first.starts[1] + kv * 6].reshape(kv, 6)
    assert (sizes.sum(axis=1) == n - 4).all() and (its_together > 0).all(), sizes  # the launch wrote them
