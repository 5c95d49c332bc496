"""The fused prefill kernels against the reference attention (the oracle).

Triton kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py when there is no GPU), so CI tests them without one; on a GPU the same cases run
compiled on CUDA tensors (and bf16, which the interpreter does not model). Shapes stay small so
the interpreter stays fast.
"""

from __future__ import annotations

import pytest
import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.kernels import interpreting, kernel_mode, triton_importable, use_triton
from ov_kvcrush.kernels.prefill import causal_prefill
from ov_kvcrush.methods import H2OConfig, MiniKVConfig, QuantSettings
from ov_kvcrush.methods.attention import attend


def _devices_and_dtypes() -> list:
    out = []
    if triton_importable() and interpreting():
        out += [("cpu", torch.float32), ("cpu", torch.float16)]
    if triton_importable() and torch.cuda.is_available() and not interpreting():
        out += [("cuda", torch.float32), ("cuda", torch.float16), ("cuda", torch.bfloat16)]
    return out or [pytest.param("none", None, marks=pytest.mark.skip(reason="no Triton here"))]


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (batch, q heads, kv heads, query rows, keys, head dim, score_from)
SHAPES = [
    (1, 4, 2, 37, 37, 16, 0),  # GQA, a prompt of odd length
    (2, 4, 1, 20, 45, 24, 5),  # the last 20 positions of 45 (a later chunk), head dim not a power of 2
    (1, 2, 2, 33, 33, 32, 30),  # scores of the last rows only (SnapKV's window)
    (1, 6, 3, 1, 19, 16, 0),  # one query row: a decode step
]


@pytest.mark.parametrize(("device", "dtype"), _devices_and_dtypes())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_attention_with_scores_equals_the_reference(device, dtype, shape):
    from ov_kvcrush.kernels.flash_scores import flash_attention_with_scores

    b, hq, hk, t, n, d, score_from = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(b, t, hq, d, generator=gen).transpose(1, 2)  # transformers' strided layout
    k = torch.randn(b, hk, n, d, generator=gen) * 2
    v = torch.randn(b, hk, n, d, generator=gen)
    pos = torch.arange(n)
    scale = 0.7 / d**0.5
    out, scores = flash_attention_with_scores(
        *(x.to(device, dtype) for x in (q, k, v)), scale, score_from=score_from
    )  # fmt: skip
    want = attend(q, k, v, q_positions=pos[n - t :], k_positions=pos, scale=scale)
    want_scores = attend(
        q[:, :, score_from:], k, v, q_positions=pos[n - t + score_from :], k_positions=pos, scale=scale,
        return_scores=True,
    ).scores  # fmt: skip
    assert out.dtype == dtype and out.shape == (b, hq, t, d)
    tol = TOLERANCE[dtype]
    assert torch.allclose(out.float().cpu(), want.output, atol=tol * 4, rtol=tol * 4)
    assert torch.allclose(scores.cpu(), want_scores, atol=tol * 4, rtol=tol * 4)
    # every counted row's probabilities sum to one: the column sums add up to the rows counted
    assert torch.allclose(scores.sum(-1).cpu(), torch.full((b, hq), float(t - score_from)), atol=tol * t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_causal_prefill_without_scores_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 50, 16, generator=gen) for h in (4, 2, 2))
    pos = torch.arange(50)
    got = causal_prefill(q.to(dtype), k.to(dtype), v.to(dtype), 0.2)
    assert got is not None and got[1] is None and got[0].dtype == dtype
    want = attend(q, k, v, q_positions=pos, k_positions=pos, scale=0.2).output
    assert torch.allclose(got[0].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_no_fast_path_for_scores_where_triton_does_not_run(monkeypatch):
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", "torch")
    q = torch.randn(1, 2, 8, 16)
    assert causal_prefill(q, q, q, None, return_scores=True) is None  # the caller runs the reference


@pytest.mark.skipif(not (triton_importable() and interpreting()), reason="needs Triton's interpreter")
@pytest.mark.parametrize(
    "config", [H2OConfig(budget=24, recent_tokens=4), MiniKVConfig(budget=24, recent_tokens=4, selection="h2o")]
)
def test_a_scoring_method_keeps_the_same_tokens_with_the_kernel(monkeypatch, config):
    """The layer cache's prefill routes through the kernel; what it keeps and answers stays the reference's."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 4, 60, 16, generator=gen),
        torch.randn(1, 2, 60, 16, generator=gen),
        torch.randn(1, 2, 60, 16, generator=gen),
    )
    steps = [tuple(torch.randn(1, h, 1, 16, generator=gen) for h in (4, 2, 2)) for _ in range(3)]

    def run(mode: str):
        monkeypatch.setenv("OV_KVCRUSH_KERNELS", mode)
        lc = config.make_layer(0, 1)
        outs = [lc.prefill(q, k, v)] + [lc.decode(*s) for s in steps]
        return outs, lc.store.dense()[2]

    from ov_kvcrush.kernels import flash_scores

    calls = []
    kernel = flash_scores.flash_attention_with_scores
    monkeypatch.setattr(flash_scores, "flash_attention_with_scores", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    ref_outs, ref_kept = run("torch")
    assert not calls
    outs, kept = run("triton")
    assert calls, "the prefill did not go through the kernel"
    assert torch.equal(kept, ref_kept)
    for got, want in zip(outs, ref_outs, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def test_kernel_mode_is_checked(monkeypatch):
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", "cuda")
    with pytest.raises(ConfigError, match=r"OV_KVCRUSH_KERNELS.*auto, triton, torch"):
        kernel_mode()
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_importable():
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            use_triton(torch.device("cpu"))
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", "auto")
    assert use_triton(torch.device("cpu")) is False


@pytest.mark.parametrize(("device", "dtype"), _devices_and_dtypes())
@pytest.mark.parametrize(
    ("tokens", "group", "residual", "hq", "hk", "bits"),
    [(100, 16, 32, 4, 2, (2, 2)), (200, 32, 64, 2, 2, (4, 4)), (7, 16, 16, 4, 1, (2, 2)), (150, 16, 32, 4, 2, (2, 4))],
)
def test_quant2_decode_attention_equals_the_reference_over_the_dequantised_store(
    device, dtype, tokens, group, residual, hq, hk, bits
):
    """The 2-/4-bit store read in place (codes unpacked and dequantised inside the kernel) against
    the reference: :meth:`QuantStore.dense` (the dequantised store) then :func:`attend`."""
    from ov_kvcrush.kernels.quant2_attention import quant2_decode_attention
    from ov_kvcrush.methods.store import QuantStore

    gen = torch.Generator().manual_seed(tokens + group)
    d = 32
    store = QuantStore(QuantSettings(group_size=group, residual_tokens=residual, key_bits=bits[0], value_bits=bits[1]))
    k, v = torch.randn(1, hk, tokens, d, generator=gen) * 2, torch.randn(1, hk, tokens, d, generator=gen)
    k[:, :, :, 3] += 5  # an outlier channel, as keys have
    store.append(k.to(dtype), v.to(dtype), torch.arange(tokens))
    q = torch.randn(1, hq, 1, d, generator=gen).to(dtype)
    dense_k, dense_v, _ = store.dense()
    want = attend(q, dense_k, dense_v, scale=0.3).output
    rk = torch.zeros(1, hk, residual, d, dtype=dtype)
    rk[:, :, : store.residual_len] = store.rk
    rv = torch.zeros_like(rk)
    rv[:, :, : store.residual_len] = store.rv
    n_q = store.quantized_tokens
    packed = tuple(
        (x if x is not None else torch.zeros(1, hk, 1, d, dtype=torch.int32)).to(device)
        for x in (store.qk, store.k_scale, store.k_zero, store.qv, store.v_scale, store.v_zero)
    )
    got = quant2_decode_attention(
        q.to(device), packed, n_q, group, rk.to(device), rv.to(device),
        torch.tensor([store.residual_len], device=device), scale=0.3, key_bits=bits[0], value_bits=bits[1],
    )  # fmt: skip
    assert got.dtype == dtype
    tol = TOLERANCE[dtype] * 5
    assert torch.allclose(got.float().cpu(), want.float(), atol=tol, rtol=tol)


# (batch, q heads, kv heads, store slots, head dim, attended: "prefix" | "slots")
DECODE_SHAPES = [
    (1, 4, 2, 300, 16, "prefix"),  # a long prefix: several chunks merged
    (2, 6, 2, 70, 24, "prefix"),  # a group of 3, head dim not a power of 2
    (1, 4, 2, 300, 16, "slots"),  # per-head slots, some -1, some past the length
    (2, 2, 2, 40, 32, "slots"),  # one query head per KV head
]


@pytest.mark.parametrize(("device", "dtype"), _devices_and_dtypes())
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_decode_attention_equals_the_reference_over_the_attended_keys(device, dtype, shape, monkeypatch):
    """The split-key decode kernel against :func:`attend` over exactly the keys each KV head
    attends, gathered: a held prefix of the store (``length``), or per-head slots with ``-1``
    and slots past the length masked."""
    from ov_kvcrush.kernels import decode

    b, hq, hk, cap, d, mode = shape
    monkeypatch.setattr(decode, "MIN_CHUNK", 64)  # several chunks even for small stores
    gen = torch.Generator().manual_seed(cap + d)
    q = torch.randn(b, 1, hq, d, generator=gen).transpose(1, 2)  # transformers' strided layout
    k = torch.randn(b, hk, cap, d, generator=gen) * 2
    v = torch.randn(b, hk, cap, d, generator=gen)
    n = cap - 37  # slots held; the rest of the capacity is unwritten (garbage, must not count)
    k[:, :, n:] = 1e4
    slots = None
    if mode == "slots":
        slots = torch.stack([torch.randperm(cap, generator=gen)[: cap // 2] for _ in range(b * hk)]).view(b, hk, -1)
        slots[..., ::7] = -1
    length = torch.tensor([n])
    got = decode.decode_attention(
        *(x.to(device, dtype) for x in (q, k, v)), 0.3,
        length=length.to(device), slots=None if slots is None else slots.to(device),
    )  # fmt: skip
    want = torch.empty(b, hq, 1, d)
    g = hq // hk
    for bi in range(b):
        for h in range(hk):
            keep = torch.arange(n) if slots is None else slots[bi, h][(slots[bi, h] >= 0) & (slots[bi, h] < n)]
            rows = q[bi : bi + 1, h * g : (h + 1) * g]
            kk, vv = k[bi : bi + 1, h : h + 1, keep], v[bi : bi + 1, h : h + 1, keep]
            zero = torch.zeros(1, dtype=torch.long)
            kk, vv = kk.expand(1, g, -1, -1), vv.expand(1, g, -1, -1)
            everything = zero.expand(len(keep))  # every attended key visible
            want[bi, h * g : (h + 1) * g] = attend(
                rows, kk, vv, q_positions=zero, k_positions=everything, scale=0.3
            ).output[0]
    tol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == (b, hq, 1, d)
    assert torch.allclose(got.float().cpu(), want, atol=tol * 4, rtol=tol * 4)


def test_the_split_plan_fills_the_gpu_and_covers_every_key():
    from ov_kvcrush.kernels.decode import MIN_CHUNK, plan_splits

    for rows, keys in [(8, 32768), (8, 1344), (1, 10), (64, 100_000), (8, 256)]:
        chunk, splits = plan_splits(rows, keys)
        assert chunk * splits >= keys > chunk * (splits - 1)  # every key in exactly one chunk
        assert chunk % 64 == 0 and (splits == 1 or chunk >= MIN_CHUNK)


@pytest.mark.parametrize(("device", "dtype"), _devices_and_dtypes())
@pytest.mark.parametrize(("bsz", "n", "k", "d"), [(2, 100, 7, 16), (3, 50, 40, 24), (1, 33, 1, 32)])
def test_one_device_kmeans_step_is_the_nearest_direction(device, dtype, bsz, n, k, d):
    """One iteration of :func:`lloyd_on_device` against the reference assignment (``matmul`` then
    ``argmax``): the same labels and objective in float32; in TF32 (CUDA) the same labels wherever
    the two best directions are apart by more than TF32's error. Duplicate directions: the first
    one wins. The directions move to the members' normalised sums, as the reference's."""
    from ov_kvcrush.kernels.kmeans import lloyd_on_device
    from ov_kvcrush.methods.clusterkv import nearest_direction

    if dtype != torch.float32:
        pytest.skip("k-means runs in float32")
    gen = torch.Generator().manual_seed(n + k)
    x = torch.nn.functional.normalize(torch.randn(bsz, n, d, generator=gen), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(bsz, k, d, generator=gen), dim=-1)
    if k > 2:
        c[:, 2] = c[:, 0]  # a tie: label 0, never 2
    want_labels, want_best = nearest_direction(x, c)
    precision = "tf32" if device == "cuda" else "ieee"
    labels, dirs, iterations, objective = lloyd_on_device(x.to(device), c.to(device), 1, precision=precision)
    labels, dirs = labels.cpu(), dirs.cpu()
    assert labels.dtype == torch.long and int(iterations) == 1 and objective.shape == (1,)
    if k > 2:
        assert (labels != 2).all()
    sums = torch.zeros(bsz, k, d).scatter_add_(1, labels.unsqueeze(-1).expand(bsz, n, d), x)
    norms = sums.norm(dim=-1, keepdim=True)
    assert torch.allclose(dirs, torch.where(norms > 0, sums / norms.clamp_min(1e-30), c), atol=1e-5)
    if precision == "ieee":
        assert torch.equal(labels, want_labels)
        assert float(objective[0]) == pytest.approx(float((1 - want_best).sum()), rel=1e-5)
    else:
        top2 = torch.matmul(x, c.transpose(1, 2)).topk(min(2, k), dim=-1).values
        clear = (top2[..., 0] - top2[..., -1] > 1e-2) | (k == 1)
        assert torch.equal(labels[clear], want_labels[clear])
        assert float(objective[0]) == pytest.approx(float((1 - want_best).sum()), rel=1e-3)


@pytest.mark.parametrize(("device", "dtype"), _devices_and_dtypes())
@pytest.mark.parametrize(("max_iters", "clustered"), [(50, True), (3, True), (50, False)])
def test_device_kmeans_loop_is_the_reference_loop(device, dtype, max_iters, clustered):
    """:func:`lloyd_on_device` runs ``max_iters`` launches without waiting for the host: it must
    still stop where the reference stops (no label moved), with the reference's labels,
    directions, iteration count and objective -- converged, and capped at 3 iterations. Float32
    products on every device (the TF32 labels are the single step's test)."""
    from ov_kvcrush.kernels.kmeans import lloyd_on_device
    from ov_kvcrush.methods.clusterkv import lloyd_iterations

    if dtype != torch.float32:
        pytest.skip("k-means runs in float32")
    gen = torch.Generator().manual_seed(max_iters)
    bsz, n, k, d = 2, 120, 6, 16
    x = torch.randn(bsz, n, d, generator=gen)
    if clustered:  # six blobs: converges in a few steps
        x = x * 0.3 + 3 * torch.randn(bsz, k, d, generator=gen).repeat_interleave(n // k, dim=1)
    xn = torch.nn.functional.normalize(x, dim=-1)
    c = xn[:, :k].clone()
    want_labels, want_dirs, want_iters, want_obj = lloyd_iterations(xn, c, max_iters)
    assert (want_iters < max_iters) == (max_iters == 50)  # the cases test what they say
    labels, dirs, iterations, objective = lloyd_on_device(xn.to(device), c.to(device), max_iters)
    assert int(iterations) == want_iters
    assert torch.equal(labels.cpu(), want_labels)
    assert torch.allclose(dirs.cpu(), want_dirs, atol=1e-4)
    got_obj = objective.cpu()
    assert got_obj[:want_iters].tolist() == pytest.approx(want_obj, rel=1e-4, abs=1e-3)
    assert not got_obj[want_iters:].any()  # nothing ran after convergence


# (batch, q heads, kv heads, clustered tokens, clusters, budget): ties, empty clusters, a budget over the tokens
SELECTIONS = [
    (1, 4, 2, 90, 7, 40),  # the last recalled cluster trimmed
    (2, 6, 3, 200, 33, 64),  # a batch of two sequences, a cluster count past a power of two
    (1, 2, 1, 50, 1, 20),  # one cluster
    (1, 4, 2, 60, 9, 500),  # a budget over every clustered token
    (1, 2, 1, 60, 6, 25),  # every cluster scores alike: the budget's boundary falls inside the tie
    (2, 4, 2, 4000, 700, 1024),  # hundreds of clusters a row, as at 32k tokens
]


@pytest.mark.parametrize(("device", "dtype"), [p for p in _devices_and_dtypes() if p[1] in (torch.float32, None)])
@pytest.mark.parametrize("shape", SELECTIONS, ids=lambda s: "x".join(map(str, s)))
def test_fused_cluster_selection_is_the_reference_selection(device, dtype, shape):
    """:func:`select_recalled` finds the budget's boundary score by bisection and places only the
    budget's tokens: the same tokens as the reference's ranking and trimming, with equal scores
    (duplicated centroids, empty clusters' zero centroids) ranked by the lower cluster id; the
    recall cache's ring and counters as :class:`FastClusterKVLayerCache` counts them."""
    from ov_kvcrush.kernels.cluster_select import select_recalled
    from ov_kvcrush.methods.clusterkv import ClusterIndex, rank_clusters, select_clusters

    b, hq, hk, n, c, budget = shape
    gen = torch.Generator().manual_seed(n + c)
    rows, d = b * hk, 16
    labels = torch.randint(0, c, (rows, n), generator=gen)
    labels[:, : min(c, 3)] = 0  # cluster 0 is never empty ...
    labels[labels == c - 1] = 0 if c > 2 else labels[labels == c - 1]  # ... and the last one is, with c > 2
    centroids = torch.randn(rows, c, d, generator=gen)
    if c > 4:
        centroids[:, 3] = centroids[:, 1]  # a tie: cluster 1 must rank before cluster 3
    if c == 6:
        centroids[:] = centroids[:, :1]
    index = ClusterIndex.build(centroids, labels, torch.arange(5, 5 + n))
    index.centroids[index.sizes == 0] = 0.0  # an empty cluster's centroid, as k-means leaves it
    queries = torch.randn(b, hq, 1, d, generator=gen)
    want_tokens, want_ids = select_clusters(index, rank_clusters(queries, index.centroids, hk), budget)
    take, offset = min(budget, n), 4
    slots = torch.full((rows, offset + take + 3), -7, dtype=torch.long)
    ring = (torch.rand(3, rows, c, generator=gen) < 0.3).to(torch.int8)
    cached = ring.bool().any(0)
    ptr = torch.tensor([1])
    counts = torch.zeros(3, dtype=torch.long)
    on = lambda t: t.to(device)  # noqa: E731
    got_slots, got_ring, got_ptr, got_counts = on(slots), on(ring), on(ptr), on(counts)
    select_recalled(
        on(queries), on(index.centroids), on(index.sizes), on(index.offsets), on(index.sorted_tokens),
        budget=budget, slots=got_slots, offset=offset, counts=got_counts, ring=got_ring, ring_ptr=got_ptr,
    )  # fmt: skip
    got_slots = got_slots.cpu()
    for row in range(rows):  # the same tokens (listed cluster by cluster in id order, not in ranked order)
        got = got_slots[row, offset : offset + take]
        assert torch.equal(got.sort().values, want_tokens[row].sort().values), f"row {row}"
    assert (got_slots[:, :offset] == -7).all() and (got_slots[:, offset + take :] == -7).all()
    chosen = torch.zeros(rows, c, dtype=torch.bool)
    for row, ids in enumerate(want_ids):
        chosen[row, ids] = True
    assert torch.equal(got_ring.cpu()[1].bool(), chosen)  # this step's row of the ring
    assert torch.equal(got_ring.cpu()[[0, 2]], ring[[0, 2]])
    assert int(got_ptr) == 2
    fresh = chosen & ~cached
    want = [int(chosen.sum()), int((chosen & cached).sum()), int((index.sizes * fresh).sum())]
    assert got_counts.cpu().tolist() == want


@pytest.mark.parametrize(("device", "dtype"), _devices_and_dtypes())
@pytest.mark.parametrize(("b", "hk", "d"), [(1, 2, 16), (2, 24, 128)], ids=["one", "rows-in-blocks"])
def test_one_launch_appends_a_token_and_counts_it(device, dtype, b, hk, d):
    """:func:`append_token` writes the token where ``index_copy_`` at the count writes it (keys and
    values as strided views of a packed projection), leaves every other slot alone, and counts it."""
    from ov_kvcrush.kernels.kv_store import append_token

    gen = torch.Generator().manual_seed(hk)
    stores = [torch.randn(b, hk, 40, d, generator=gen).to(device, dtype) for _ in range(2)]
    kv = torch.randn(b, 1, 3 * hk * d, generator=gen).to(device, dtype)
    keys = kv[..., hk * d : 2 * hk * d].view(b, 1, hk, d).transpose(1, 2)
    values = kv[..., 2 * hk * d :].view(b, 1, hk, d).transpose(1, 2)
    n = torch.tensor([17], device=device)
    want = [s.clone().index_copy_(2, n, x) for s, x in zip(stores, (keys, values), strict=True)]
    append_token(*stores, keys, values, n)
    assert int(n) == 18
    for got, exp in zip(stores, want, strict=True):
        assert torch.equal(got, exp)
