"""The GPU path's decode attention and 2-bit store (issue 49) on Intel's OpenCL CPU runtime, at
sub-group sizes 8 and 16.

Oracles: the reference attention (``methods.attention.attend``) over the tokens as the store
holds them, the CPU op's own decode output over the same tokens, and the reference 2-bit
quantization (``methods.quant``), whose codes, scales and zeros must be equal, not close. The
kernels run in the ``gpu_worker`` process (conftest: Intel's runtime cannot load once openvino is
imported); without the runtime the tests skip, naming what is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import HKV, HQ, D, op_model

from ov_kvcrush.gpu import attention, layout, quant, runtime
from ov_kvcrush.methods import quant as reference_quant
from ov_kvcrush.methods.attention import attend

SUB_GROUPS = (8, 16)
PRECISIONS_SEED = {"f32": 0, "f16": 100, "u8": 200}


def reference_decode(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray]):
    """Each query head's output and probabilities over its KV head's stored tokens."""
    group = q.shape[0] // len(keys)
    outs, probs = [], []
    for h in range(q.shape[0]):
        k, v = keys[h // group], values[h // group]
        res = attend(
            torch.from_numpy(q[h][None, None, None]),
            torch.from_numpy(k[None, None]),
            torch.from_numpy(v[None, None]),
            q_positions=torch.tensor([k.shape[0]]),
            k_positions=torch.arange(k.shape[0]),
            return_scores=True,
        )
        outs.append(res.output[0, 0, 0].numpy())
        probs.append(res.scores[0, 0].numpy())
    return outs, probs


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize("precision", layout.PRECISIONS)
def test_paged_decode_is_the_reference_over_each_heads_stored_tokens(gpu_worker, precision, sub_group):
    """Heads holding different token counts (as per-head eviction leaves them), their blocks at
    shuffled ids among garbage blocks, a partial last block: output and probabilities."""
    rng = np.random.default_rng(PRECISIONS_SEED[precision] + sub_group)
    shape = layout.PoolShape(precision, 32, 64, group=3)
    lengths = [100, 37, 64]
    keys = [rng.standard_normal((n, 64), dtype=np.float32) * 2 for n in lengths]
    values = [rng.standard_normal((n, 64), dtype=np.float32) for n in lengths]
    paged = layout.page_heads(shape, keys, values, rng)
    q = rng.standard_normal((9, 64), dtype=np.float32)
    out, probs = gpu_worker.submit(
        attention.paged_decode, shape, paged.pool, paged.tables, paged.lengths, q, 64**-0.5, sub_group
    ).result()
    ref_out, ref_probs = reference_decode(
        q, [layout.stored(shape, k) for k in keys], [layout.stored(shape, v) for v in values]
    )
    for h in range(9):
        np.testing.assert_allclose(out[h], ref_out[h], rtol=1e-5, atol=1e-5)
        n = lengths[h // 3]
        np.testing.assert_allclose(probs[h, :n], ref_probs[h], rtol=1e-5, atol=1e-7)
        assert not probs[h, n:].any()


@pytest.mark.parametrize("precision", ["f16", "u8"])
def test_paged_decode_equals_the_cpu_op_over_the_same_store(gpu_worker, ov_core, precision):
    """The CPU op stores a prompt and a decode token; the GPU layout of the same vectors holds
    exactly what the op reads back, and the kernels' decode output is the op's."""
    from ov_kvcrush.op import kvcache

    rng = np.random.default_rng(7)
    n = 150
    q = rng.standard_normal((1, HQ, n + 1, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, n + 1, D), dtype=np.float32) * 3 + 1
    v = rng.standard_normal((1, HKV, n + 1, D), dtype=np.float32)
    pool = kvcache.KVPool(1, HQ, HKV, D, block_size=32, precision=precision)
    seq = pool.new_sequence()
    req = op_model(ov_core, HQ, HKV, D)
    for lo, hi in ((0, n), (n, n + 1)):
        feed = {"q": q[:, :, lo:hi], "k": k[:, :, lo:hi], "v": v[:, :, lo:hi], "kvc_sequence": np.array([seq.handle])}
        op_out = np.array(req.infer(feed)[0])[0, :, -1]
    shape = layout.PoolShape(precision, 32, D, group=HQ // HKV)
    for g in range(HKV):  # the same codes and scales: one u8 step is ~0.05 here, these are float rounding
        _pos, keys, values, _ = seq.read_head(0, g)
        np.testing.assert_allclose(keys, layout.stored(shape, k[0, g]), rtol=1e-6, atol=2e-6)
        np.testing.assert_allclose(values, layout.stored(shape, v[0, g]), rtol=1e-6, atol=2e-6)
    pool.close()
    paged = layout.page_heads(shape, list(k[0]), list(v[0]), rng)
    out, _ = gpu_worker.submit(
        attention.paged_decode, shape, paged.pool, paged.tables, paged.lengths, q[0, :, -1], D**-0.5, 16
    ).result()
    np.testing.assert_allclose(out, op_out.reshape(HQ, D), rtol=1e-4, atol=1e-5)


def test_a_sub_group_size_the_device_lacks_is_refused_by_name(gpu_worker):
    with pytest.raises(runtime.GPUPathError, match=r"sub_group=4 is not supported .* allowed"):
        gpu_worker.submit(attention.paged_decode, layout.PoolShape("f32", 32, 64), *empty_heads(), 4).result()


def empty_heads():
    return (
        np.zeros(layout.PoolShape("f32", 32, 64).block_bytes, np.uint8),
        np.zeros((1, 1), np.int32),
        np.ones(1, np.int32),
        np.zeros((1, 64), np.float32),
        1.0,
    )


QUANT_SHAPES = [(2, 2), (4, 2), (2, 4)]


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize(("key_bits", "value_bits"), QUANT_SHAPES)
def test_2bit_blocks_hold_the_references_codes_scales_and_zeros(gpu_worker, key_bits, value_bits, sub_group):
    """Keys per channel over groups of 16 tokens, values per token over groups of 16 channels
    (MiniKV's grouping), blocks at scattered ids, a constant group (scale 0): the packed key
    codes are the reference's words, and the blocks read back as the reference dequantizes."""
    rng = np.random.default_rng(key_bits * 10 + value_bits + sub_group)
    shape = layout.QuantShape(32, 64, 16, key_bits, value_bits)
    k = rng.standard_normal((5, 32, 64), dtype=np.float32) * 2
    v = rng.standard_normal((5, 32, 64), dtype=np.float32)
    k[0, :16, 3] = 1.5
    ids = np.array([4, 0, 6, 2, 3])
    pool = gpu_worker.submit(quant.quantize_blocks, shape, k, v, ids, 8, sub_group).result()
    kc, ks, kz = reference_quant.quantize_groups(torch.from_numpy(k), 16, dim=-2, bits=key_bits)
    vc, vs, vz = reference_quant.quantize_groups(torch.from_numpy(v), 16, dim=-1, bits=value_bits)
    for b, block in enumerate(ids):
        data = pool[block * shape.block_bytes : (block + 1) * shape.block_bytes]
        words = data[: 64 * 32 * key_bits // 8].view(np.uint32).reshape(64, -1)
        want = reference_quant.pack_codes(kc[b].T.contiguous(), bits=key_bits, dim=-1).numpy().astype(np.uint32)
        np.testing.assert_array_equal(words, want)
    kd, vd = gpu_worker.submit(quant.dequantize_blocks, shape, pool, ids, sub_group).result()
    np.testing.assert_array_equal(kd, reference_quant.dequantize_groups(kc, ks, kz, 16, -2, torch.float32).numpy())
    np.testing.assert_array_equal(vd, reference_quant.dequantize_groups(vc, vs, vz, 16, -1, torch.float32).numpy())


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
def test_decode_over_2bit_slots_then_full_precision_slots_is_the_reference(gpu_worker, sub_group):
    """MiniKV's store: each head's flushed 2-bit blocks first, then its full-precision tail, one
    softmax over both; a head with one 2-bit block, another with a short tail."""
    rng = np.random.default_rng(11 + sub_group)
    qshape = layout.QuantShape(32, 64, 16, 2, 2, group=3)
    ids = np.array([4, 0, 6, 2, 3])
    k = rng.standard_normal((5, 32, 64), dtype=np.float32)
    v = rng.standard_normal((5, 32, 64), dtype=np.float32)
    qpool = gpu_worker.submit(quant.quantize_blocks, qshape, k, v, ids, 8, sub_group).result()
    kd, vd = gpu_worker.submit(quant.dequantize_blocks, qshape, qpool, ids, sub_group).result()
    qheads = attention.HeadTables(np.array([[4, 0], [6, 2], [3, -1]], np.int32), np.array([64, 64, 32], np.int32))
    shape = layout.PoolShape("f16", 32, 64, group=3)
    lengths = [40, 7, 33]
    keys = [rng.standard_normal((n, 64), dtype=np.float32) for n in lengths]
    values = [rng.standard_normal((n, 64), dtype=np.float32) for n in lengths]
    paged = layout.page_heads(shape, keys, values, rng)
    q = rng.standard_normal((9, 64), dtype=np.float32)
    out, probs = gpu_worker.submit(
        attention.paged_decode,
        shape,
        paged.pool,
        paged.tables,
        paged.lengths,
        q,
        0.125,
        sub_group,
        quant=(qshape, qpool, qheads),
    ).result()
    block = {int(b): i for i, b in enumerate(ids)}
    held_k, held_v = [], []
    for g in range(3):
        mine = [block[int(b)] for b in qheads.tables[g] if b >= 0]
        held_k.append(np.concatenate([*kd[mine], layout.stored(shape, keys[g])]))
        held_v.append(np.concatenate([*vd[mine], layout.stored(shape, values[g])]))
    ref_out, ref_probs = reference_decode(q * 0.125 / 64**-0.5, held_k, held_v)
    for h in range(9):
        np.testing.assert_allclose(out[h], ref_out[h], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(probs[h, : len(ref_probs[h])], ref_probs[h], rtol=1e-5, atol=1e-7)
