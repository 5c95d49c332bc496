"""Chelsea on the Intel GPU path (issue 71): its merge kernel (``plugins/gpu/kernels/chelsea.h``)
against the reference's :func:`~ov_kvcrush.methods.chelsea.chelsea_compress` on Intel's OpenCL
CPU runtime, then ``device="GPU"``: the prompt merged after it is attended, a decode step's heads
merged by the model's merge layer before they are attended with ``log(degree)``
(``ov_kvcrush/gpu/chelsea_cache.py``), run by OpenVINO's GPU plugin under the emulation layer on
the family checks' tiny random-weight Llama 3 (2 layers, 8 query and 2 KV heads of 32 dims).
Oracle there: the CPU op's greedy tokens, KV bytes and tokens held per head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import batched_beside_decoding, teacher_forced

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.gpu.chelsea import MERGE_FIELDS, MERGE_WIDTH, merge_rows, method_fields
from ov_kvcrush.gpu.layout import PoolShape, stored, unpack_block
from ov_kvcrush.gpu.store import store_tokens
from ov_kvcrush.methods.chelsea import calibrate_outlier_heads, chelsea_compress

# --------------------------------------------------------------------------------------------
# the merge kernel


def _kernel_case(gpu_worker, precision: str, n: int, target: int, protect: int, schedule=(0, 0, 0), value=False):
    """The kernel's merge of two KV heads of ``n`` random tokens (a run of alike keys among them)
    and the reference's over the same stored tokens: (kernel keys, values, degrees, scores;
    reference's), each ``[kv, target, ...]``."""
    kv, d, bs, group, cap = 2, 32, 16, 2, n + 8
    rng = np.random.default_rng(n + target + protect)
    shape = PoolShape(precision, bs, d)
    per_head = -(-n // bs)
    tables = np.arange(kv * per_head, dtype=np.int32).reshape(kv, per_head)[:, ::-1].copy()  # blocks out of order
    keys = rng.standard_normal((kv, n, d)).astype(np.float32)
    keys[:, 10:20] = keys[:, 10:11] + 0.01 * keys[:, 10:20]  # a run of near-equal keys merges first
    values = rng.standard_normal((kv, n, d)).astype(np.float32)
    scores = rng.random((kv, group, n)).astype(np.float32)
    pool = np.zeros(kv * per_head * shape.block_bytes, np.uint8)
    pool = gpu_worker.submit(store_tokens, shape, pool, tables, np.zeros(kv, np.int32), keys, values).result()
    fields = np.zeros((kv, MERGE_WIDTH), np.int32)
    col = {name: MERGE_FIELDS.index(name) for name in MERGE_FIELDS}
    fields[:, col["held"]], fields[:, col["target"]], fields[:, col["capacity"]] = n, target, cap
    fields[:, col["degrees"]] = np.arange(kv) * cap
    fields[:, col["scores"]] = (kv + np.arange(kv)) * cap
    ratio, decay, steps = schedule
    link = "key_value" if value else "key"
    settings = {"sinks": 2, "recent": 4, "chunk": 8, "protect": protect, "ratio_e4": ratio, "decay_e4": decay,
                "decay_steps": steps, "link_score": link}  # fmt: skip
    fields[:, col["sinks"] :] = method_fields(settings)
    pool, words = gpu_worker.submit(merge_rows, shape, pool, tables, fields, scores).result()
    got_k, got_v = np.zeros((kv, target, d), np.float32), np.zeros((kv, target, d), np.float32)
    for h in range(kv):
        for j in range(target):
            block = pool[tables[h, j // bs] * shape.block_bytes :][: shape.block_bytes]
            k, v = unpack_block(shape, block, bs)
            got_k[h, j], got_v[h, j] = k[j % bs], v[j % bs]
    got_w = np.stack([words[h * cap : h * cap + cap] for h in range(kv)])
    got_s = np.stack([words[(kv + h) * cap : (kv + h) * cap + cap] for h in range(kv)])
    as_held = [torch.from_numpy(np.stack([stored(shape, x) for x in xs])) for xs in (keys, values)]
    sums = torch.from_numpy(scores.sum(axis=1))
    ref = chelsea_compress(*as_held, torch.ones(kv, n), target, 2, 4, 8, schedule, value, scores=sums, protect=protect)
    ref_s = torch.gather(sums, 1, ref[3]).numpy()
    return (got_k, got_v, got_w, got_s), (ref[0].numpy(), ref[1].numpy(), ref[2].numpy(), ref_s)


#: (tokens, target, protect, schedule (ratio, decay, steps in 1/10000), value-aware links): the
#: window's favourites kept out; the paper's merge in two passes; its schedule (four passes);
#: links by key and value; a target the row already meets (its degrees and scores written only)
KERNEL_CASES = [
    (70, 30, 10, (0, 0, 0), False),
    (70, 30, 0, (0, 0, 0), False),
    (70, 30, 0, (3500, 1000, 2), False),
    (100, 40, 10, (0, 0, 0), True),
    (40, 40, 10, (0, 0, 0), False),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_the_merge_kernel_is_the_references_at_f32(gpu_worker, case):
    n, target = case[:2]
    got, ref = _kernel_case(gpu_worker, "f32", *case)
    for g, r in zip(got[:2], ref[:2], strict=True):
        np.testing.assert_array_equal(g, r)  # the same arithmetic in the same order
    np.testing.assert_array_equal(got[2][:, :target], ref[2])
    np.testing.assert_array_equal(got[3][:, :target], ref[3])
    assert (got[2][:, target:] == 1).all() and (got[3][:, target:] == 0).all()  # the room after: new tokens'
    if n > target:
        assert (ref[2] > 1).any()


@pytest.mark.parametrize("precision", ["f16", "u8"])
def test_the_merge_kernel_writes_the_store_precision(gpu_worker, precision):
    """One pass (the reference reads the merged tokens in f32 for a second): the degrees and
    scores are the reference's, the keys and values as the store rounds them."""
    got, ref = _kernel_case(gpu_worker, precision, 70, 50, 5)
    np.testing.assert_array_equal(got[2][:, :50], ref[2])
    np.testing.assert_array_equal(got[3][:, :50], ref[3])
    for g, r in zip(got[:2], ref[:2], strict=True):
        np.testing.assert_allclose(g, r, atol=2e-3 if precision == "f16" else 2e-2)


# --------------------------------------------------------------------------------------------
# device="GPU" against the CPU op

BLOCK, NEW_TOKENS = 16, 14
#: (budget, options): the window's favourites kept out (the default), merged every 4 decode
#: steps; the paper's merge with its schedule and links by key and value; an outlier head kept
#: whole (the other heads' budget falls as it grows); the engines' default outliers, calibrated
CASES = [
    (48, {"sink_tokens": 4, "recent_tokens": 8, "chunk_size": 16, "merge_interval": 4, "outlier_heads": ()}),
    (48, {"sink_tokens": 4, "recent_tokens": 8, "chunk_size": 16, "merge_interval": 4, "outlier_heads": (),
          "preset": "paper", "merge_ratio": 0.35, "ratio_decay": 0.1, "decay_steps": 2, "link_score": "key_value"}),
    (64, {"sink_tokens": 2, "recent_tokens": 6, "chunk_size": 8, "merge_interval": 5, "outlier_heads": ((1, 0),)}),
    (64, {"sink_tokens": 2, "recent_tokens": 6, "chunk_size": 8, "merge_interval": 5}),
]  # fmt: skip


def _compression(budget: int, options: dict) -> CompressionConfig:
    options = dict(options)
    sinks, recent = options.pop("sink_tokens"), options.pop("recent_tokens")
    return CompressionConfig(method="chelsea", budget=budget, sink_tokens=sinks, recent_tokens=recent, options=options)


def _chelsea(model_dir: str, ids: list[int], device: str) -> tuple[list, list]:
    """Each case's greedy tokens and KV bytes for ``ids`` and for a prompt shorter than the budget
    (its first merge in a decode step), then the tokens held per layer and head after ``ids``;
    and each run's merges, as the device counts them."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    engine = OpenVINOEngine(model_dir, device=device, kv_precision="f32", block_size=BLOCK, properties=F32)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out: list = []
    merges = []
    try:
        for case in CASES:
            engine.set_compression(_compression(*case))
            for prompt in (ids, ids[:40]):
                res = engine.batcher.run(prompt, settings, None)
                out.append((list(res.token_ids), res.kv_bytes))
                merges.append(res.counters.get("merges", 0))
            engine.prefill(ids)
            out.append(engine.sequence.head_tokens().tolist())
            engine.cache.reset()
    finally:
        engine.close()
    return out, merges


@pytest.mark.model
def test_chelsea_on_gpu_keeps_the_cpu_ops_tokens_and_heads(emulation_worker, tiny_llama3_ir):
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 380, 300)]
    want = _chelsea(tiny_llama3_ir, ids, "CPU")[0]  # writes the model's calibration: the GPU reads it
    got, merges = emulation_worker.submit(_chelsea, tiny_llama3_ir, ids, "GPU").result(timeout=900)
    assert got == want
    assert all(merges[0::2]) and merges[1]  # every prompt merged; the first case's short one while decoding
    held = np.array(want[8])  # the outlier head keeps the whole prompt, the others less
    assert held[1, 0] == len(ids) and held[1, 1] < len(ids)


#: the batch: four prompts decoding together when a fifth arrives in chunks (prompt tokens each)
BATCH_PROMPTS = (150, 90, 121, 70, 110)
#: a step's tokens: a prompt goes in chunks of 32 beside four decoding sequences
STEP_TOKENS = 36


@pytest.mark.model
def test_chelsea_on_gpu_merges_prompts_in_chunks_beside_decoding_sequences(emulation_worker, tiny_llama3_ir):
    """Each prompt is merged after its last chunk (its window's scores summed over the chunks)
    while the others decode, and the decoding sequences' heads merge in the model's steps, several
    in one step: every request's tokens on the GPU and on the CPU op equal its prompt's alone and
    whole on the CPU op."""
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(10, 380, n)] for n in BATCH_PROMPTS]
    args = (_compression(*CASES[0]), BLOCK, NEW_TOKENS, STEP_TOKENS)
    cpu = batched_beside_decoding(tiny_llama3_ir, prompts, "CPU", *args)
    got = emulation_worker.submit(batched_beside_decoding, tiny_llama3_ir, prompts, "GPU", *args, False).result(
        timeout=900
    )
    assert got[0] == cpu[0] == cpu[1]  # the GPU together, the CPU op together and whole
    assert cpu[2]["prefill_chunks"] > len(prompts) and got[2]["prefill_chunks"] > len(prompts)


def _layer_keys(model_dir: str, ids: list[int], device: str) -> list[np.ndarray]:
    """The keys a calibration measures after ``ids``, each layer's ``[kv_heads, n, d]``: through
    our layers in the GPU plugin, or the CPU op's."""
    from ov_kvcrush.engines import calibration
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    engine = OpenVINOEngine(model_dir, device=device, kv_precision="f32", block_size=BLOCK, properties=F32)
    try:
        plugin = engine.plugin
        keys = plugin.layer_keys(ids, engine.max_kv_blocks) if plugin else calibration.op_layer_keys(engine, ids)
        return [k[0].numpy() for k in keys]
    finally:
        engine.close()


@pytest.mark.model
def test_chelseas_calibration_on_gpu_measures_the_cpu_ops_keys(emulation_worker, tiny_llama3_ir):
    """``outlier_heads="auto"`` on device GPU (the engines' default) calibrates on the keys of a
    prompt through our layers in the GPU plugin: the CPU op's keys, and so its outlier heads."""
    ids = [int(t) for t in np.random.default_rng(3).integers(10, 380, 200)]
    want = _layer_keys(tiny_llama3_ir, ids, "CPU")
    got = emulation_worker.submit(_layer_keys, tiny_llama3_ir, ids, "GPU").result(timeout=900)
    assert [k.shape for k in got] == [k.shape for k in want] == [(2, len(ids), 32)] * 2
    for g, w in zip(got, want, strict=True):  # the plugin's f32 products are not the CPU's: 2e-4 apart
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
    # half the heads (the paper's 4 % of this model's four is none), by the share of weak links
    pairs = [calibrate_outlier_heads([torch.from_numpy(k)[None] for k in keys], chunk_size=16, ratio=0.5)
             for keys in (got, want)]  # fmt: skip
    assert pairs[0] == pairs[1] and len(pairs[0]) == 2


def _teacher_forced(model_dir: str, ids: list[int], forced: list[int], device: str, properties: dict) -> list:
    """The first three cases' logits after ``ids`` (merged) and after each token of ``forced`` fed
    in turn (:func:`helpers.teacher_forced`; merges every few tokens)."""
    compressions = [_compression(*c) for c in CASES[:3]]
    return teacher_forced(model_dir, ids, forced, device, properties, compressions, BLOCK)


#: the largest logit error allowed of the GPU in f16 (its default) against the CPU op in f32,
#: relative to the largest logit: half precision's rounding of the activations, and of which
#: tokens merge where two links' similarities are close (random weights: many are)
F16_TOLERANCE = 0.15


@pytest.mark.model
def test_chelsea_on_gpu_in_f16_keeps_the_cpu_ops_f32_logits_within_tolerance(emulation_worker, tiny_llama3_ir):
    """The plugin in f16, our layers in f16: teacher-forced over merged caches (the prompt's, then
    the decode steps' merges), every case's logits stay within :data:`F16_TOLERANCE` of the CPU
    op's in f32."""
    from ov_kvcrush.tools.model_coverage import F32

    rng = np.random.default_rng(5)
    ids = [int(t) for t in rng.integers(10, 380, 300)]
    forced = [int(t) for t in rng.integers(10, 380, NEW_TOKENS)]
    want = _teacher_forced(tiny_llama3_ir, ids, forced, "CPU", F32)
    got = emulation_worker.submit(_teacher_forced, tiny_llama3_ir, ids, forced, "GPU", {}).result(timeout=900)
    for case, a, b in zip(CASES, got, want, strict=False):
        errors = np.abs(a - b).max(-1) / np.abs(b).max()
        assert (errors <= F16_TOLERANCE).all() and errors.max() > 0, (case, errors)  # 0 would mean f32 ran
