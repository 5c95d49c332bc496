"""MiniKV's 2-bit store inside OpenVINO's GPU plugin (issue 71): the store, flush and prompt
layers (``quant_step_model``) run by the plugin under the emulation layer, over a full-precision
pool and a pool of 2-bit blocks, both remote tensors of its context.

The oracle is the reference's store (``methods/quant.py``): a step that fills the residual's
chunk quantizes it, the step's own tokens among them, before attending (``QuantStore.append``), so
the flushed blocks must hold the reference's codes of the stored tokens byte for byte, and each
row must attend the dequantized chunks (the step's flushed tokens only at or before it), then the
full-precision slots it sees that were not flushed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ov_kvcrush.gpu import layer_inputs, plugin_layers, plugin_step_models
from ov_kvcrush.gpu.layout import PoolShape, QuantShape, page_heads, stored
from ov_kvcrush.methods import quant as reference_quant

Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
SHAPE = PoolShape("f16", 16, HEAD_DIM, Q_HEADS // KV_HEADS)
QSHAPE = QuantShape(32, HEAD_DIM, 16, 2, 2, group=Q_HEADS // KV_HEADS)
ATTRIBUTES = plugin_layers.LayerAttributes(SHAPE, 16, HEAD_DIM**-0.5, quant=QSHAPE)
QBLOCKS = 8  # the 2-bit pool's blocks


@dataclass
class QuantCase:
    """One step over a store of ``old`` 2-bit chunks, ``pinned`` and ``residual`` full-precision
    tokens per KV head, feeding ``rows`` tokens; the flush quantizes ``flushed`` slots from
    ``pinned`` on into each head's new blocks."""

    rows: int
    pinned: int
    residual: int
    old: int  # 2-bit chunks per head before the step
    feeds: dict[str, np.ndarray]
    pool: np.ndarray
    old_keys: list[np.ndarray]  # per head [old * 32, D]: the 2-bit chunks' tokens
    old_values: list[np.ndarray]
    keys: list[np.ndarray]  # per head: the full-precision slots after the step (the step's stored)
    values: list[np.ndarray]
    logits_bytes: int = 0  # the layers' logits input: the logits, and a decode row's partitions

    @property
    def flushed(self) -> int:
        r = QSHAPE.block_size
        return (self.residual + self.rows) // r * r


def make_case(rows: int, pinned: int, residual: int, old: int, rng) -> QuantCase:
    d, r = HEAD_DIM, QSHAPE.block_size
    held = pinned + residual
    old_keys = [rng.standard_normal((old * r, d)).astype(np.float32) for _ in range(KV_HEADS)]
    old_values = [rng.standard_normal((old * r, d)).astype(np.float32) for _ in range(KV_HEADS)]
    keys = [rng.standard_normal((held + rows, d)).astype(np.float32) for _ in range(KV_HEADS)]
    values = [rng.standard_normal((held + rows, d)).astype(np.float32) for _ in range(KV_HEADS)]
    # the step's tokens are stored by its store layer: the pool holds zeros there before it
    heads = page_heads(SHAPE, [np.pad(k[:held], ((0, rows), (0, 0))) for k in keys],
                       [np.pad(v[:held], ((0, rows), (0, 0))) for v in values], rng)  # fmt: skip
    case = QuantCase(rows, pinned, residual, old, {}, heads.pool, old_keys, old_values, keys, values)
    new = case.flushed // r
    ids = rng.permutation(QBLOCKS)[: KV_HEADS * (old + new)].reshape(KV_HEADS, old + new).astype(np.int32)
    # each row's logits asked for (a decode step's, for the methods' scores: every slot); a decode
    # row alone is split into partitions, a sub-group each, its slots across the lanes
    stride = (old + new) * r + held + rows
    parts_at, case.logits_bytes = layer_inputs.logits_layout(Q_HEADS, rows, d, stride, split=rows == 1)
    case.feeds = {
        "q": rng.standard_normal((Q_HEADS, rows, d)).astype(np.float32),
        "k": np.stack([k[held:] for k in keys]),
        "v": np.stack([v[held:] for v in values]),
        "tables": heads.tables,
        "first": np.full(KV_HEADS, held, np.int32),
        "lengths": np.full(KV_HEADS, held + rows, np.int32),
        "tokens": layer_inputs.token_tensor([rows], [rows > 1]),  # several: their own from k and v
        "step": layer_inputs.step_tensor(
            heads.tables.shape[1], rows, ids.shape[1], 0, stride, decode_split=int(rows == 1), parts_at=parts_at
        ),
        "rows": plugin_step_models.rows_input(Q_HEADS, d),
        **plugin_step_models.NO_SCORE_ROWS,
        "qtables": ids,
        "qlengths": np.full(KV_HEADS, (old + new) * r, np.int32),
        "flush": np.tile(np.array([pinned, case.flushed], np.int32), (KV_HEADS, 1)),
    }
    return case


def _run_in_worker(folder: str, cases: list[QuantCase]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """In the emulation worker: each case's old chunks quantized into a 2-bit pool by the host's
    kernels (``quant2.cl``, the reference's codes: ``test_gpu_attention``), then its step through
    the plugin; its output, the 2-bit pool after it, and the logits it wrote."""
    import openvino as ov

    from ov_kvcrush.gpu import quant
    from ov_kvcrush.op import plugin

    core = plugin.shared_core()
    model = plugin_step_models.quant_step_model(ATTRIBUTES, KV_HEADS)
    compiled = plugin_step_models.compile_step_model(core, Path(folder), ATTRIBUTES, model)
    request, context = compiled.create_infer_request(), core.get_default_context("GPU")
    results = []
    for case in cases:
        r = QSHAPE.block_size
        qpool = np.zeros(QBLOCKS * QSHAPE.block_bytes, np.uint8)
        if case.old:
            k = np.concatenate([x.reshape(case.old, r, HEAD_DIM) for x in case.old_keys])
            v = np.concatenate([x.reshape(case.old, r, HEAD_DIM) for x in case.old_values])
            qpool = quant.quantize_blocks(QSHAPE, k, v, case.feeds["qtables"][:, : case.old].reshape(-1), QBLOCKS)
        tensors = {}
        logits = np.zeros(case.logits_bytes, np.uint8)
        for name, array in (("pool", case.pool), ("qpool", qpool), ("logits", logits)):
            tensors[name] = context.create_tensor(ov.Type.u8, ov.Shape([array.size]), {})
            tensors[name].copy_from(ov.Tensor(array))
            request.set_tensor(name, tensors[name])
        for name, array in case.feeds.items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.infer()
        after, written = ov.Tensor(ov.Type.u8, ov.Shape([qpool.size])), ov.Tensor(ov.Type.u8, ov.Shape([logits.size]))
        tensors["qpool"].copy_to(after)
        tensors["logits"].copy_to(written)
        results.append((request.get_output_tensor(0).data.copy(), after.data.copy(), written.data.view(np.float32)))
    return results


def _roundtrip(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's 2-bit store of ``[n, D]`` keys and values, read back."""
    g, kb, vb = QSHAPE.qgroup, QSHAPE.key_bits, QSHAPE.value_bits
    kc, ks, kz = reference_quant.quantize_groups(torch.from_numpy(k), g, dim=-2, bits=kb)
    vc, vs, vz = reference_quant.quantize_groups(torch.from_numpy(v), g, dim=-1, bits=vb)
    return (reference_quant.dequantize_groups(kc, ks, kz, g, -2, torch.float32).numpy(),
            reference_quant.dequantize_groups(vc, vs, vz, g, -1, torch.float32).numpy())  # fmt: skip


def _expected(case: QuantCase) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Each row over the reference's store: the 2-bit chunks (the flushed ones' tokens at or
    before the row), then the full-precision slots it sees that stayed so (a chunk's own as the
    model gave them, the earlier as the f16 blocks hold them); and each row's logits
    over those slots in that order (per head, per row)."""
    held, f = case.pinned + case.residual, case.flushed
    out = np.zeros((Q_HEADS, case.rows, HEAD_DIM))
    row_logits: list[list[np.ndarray]] = [[] for _ in range(Q_HEADS)]
    for h in range(Q_HEADS):
        kv = h // SHAPE.group
        k, v = stored(SHAPE, case.keys[kv]), stored(SHAPE, case.values[kv])
        ok, ov_ = _roundtrip(case.old_keys[kv], case.old_values[kv]) if case.old else (k[:0], v[:0])
        fk, fv = _roundtrip(k[case.pinned : case.pinned + f], v[case.pinned : case.pinned + f]) if f else (k[:0], v[:0])
        if case.rows > 1:  # a chunk's own full-precision slots as the model gave them (the flushed: 2-bit)
            k, v = np.concatenate([k[:held], case.keys[kv][held:]]), np.concatenate([v[:held], case.values[kv][held:]])
        for i in range(case.rows):
            slot = held + i  # the row's own slot
            seen_fp = [j for j in range(slot + 1) if not case.pinned <= j < case.pinned + f]
            seen_q = min(f, slot + 1 - case.pinned)
            keys = np.concatenate([ok, fk[:seen_q], k[seen_fp]]).astype(np.float64)
            vals = np.concatenate([ov_, fv[:seen_q], v[seen_fp]]).astype(np.float64)
            logits = keys @ case.feeds["q"][h, i].astype(np.float64) * HEAD_DIM**-0.5
            p = np.exp(logits - logits.max())
            out[h, i] = (p / p.sum()) @ vals
            row_logits[h].append(logits)
    return out, row_logits


def test_the_plugin_flushes_a_filled_chunk_and_attends_both_pools_as_the_reference(emulation_worker, tmp_path):
    """Three steps: a decode token that fills the residual (the chunk flushed, its own token
    among it, before attending), a chunk of three rows whose first rows see only part of the
    flushed chunk, and a decode token with nothing to flush (the decode tokens a sub-group each,
    their slots of both stores split across its lanes)."""
    rng = np.random.default_rng(71)
    cases = [make_case(1, 5, 31, 2, rng), make_case(3, 5, 30, 1, rng), make_case(1, 7, 12, 2, rng)]
    got = emulation_worker.submit(_run_in_worker, str(tmp_path), cases).result(600)
    for case, (out, qpool, written) in zip(cases, got, strict=True):
        want, want_logits = _expected(case)
        np.testing.assert_allclose(out, want, atol=1e-5)
        stride = int(case.feeds["step"][4])
        logits = written[: Q_HEADS * case.rows * stride].reshape(Q_HEADS, case.rows, stride)
        lse = written[Q_HEADS * case.rows * stride :][: Q_HEADS * case.rows].reshape(Q_HEADS, case.rows)
        for h in range(Q_HEADS):  # the logits the methods' scores take: 2-bit slots, then full-precision
            for i, row in enumerate(want_logits[h]):
                np.testing.assert_allclose(logits[h, i, : len(row)], row, atol=1e-4)
                np.testing.assert_allclose(lse[h, i], np.log(np.exp(row - row.max()).sum()) + row.max(), atol=1e-4)
        r, bb = QSHAPE.block_size, QSHAPE.block_bytes
        for kv in range(KV_HEADS):
            for c in range(case.flushed // r):  # the flushed blocks: the reference's codes of the stored tokens
                span = slice(case.pinned + c * r, case.pinned + (c + 1) * r)
                want = _packed_block(stored(SHAPE, case.keys[kv][span]), stored(SHAPE, case.values[kv][span]))
                block = int(case.feeds["qtables"][kv, case.old + c])
                np.testing.assert_array_equal(qpool[block * bb : (block + 1) * bb], want)


def _packed_block(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One 2-bit block's bytes (``quant_block.h``'s layout) from the reference's codes, scales and
    zeros of ``[32, D]`` keys and values."""
    g, kb, vb = QSHAPE.qgroup, QSHAPE.key_bits, QSHAPE.value_bits
    kc, ks, kz = reference_quant.quantize_groups(torch.from_numpy(k), g, dim=-2, bits=kb)
    vc, vs, vz = reference_quant.quantize_groups(torch.from_numpy(v), g, dim=-1, bits=vb)
    parts = [
        reference_quant.pack_codes(kc.T.contiguous(), bits=kb, dim=-1).numpy().astype(np.uint32),
        ks.numpy(),
        kz.numpy(),
        reference_quant.pack_codes(vc, bits=vb, dim=-1).numpy().astype(np.uint32),
        vs.numpy(),
        vz.numpy(),
    ]
    data = np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(-1) for p in parts])
    assert data.size == QSHAPE.block_bytes
    return data
