"""KVzip on ``device="GPU"`` (issue 71): its scoring pass fed through the model in OpenVINO's GPU
plugin, each step attending the sinks and the chunk it repeats (gathered into a view of their
own), the chunk's tokens scored on the device, then one threshold over every layer and head
(``ov_kvcrush/gpu/kvzip_cache.py``). Run by the plugin on Intel's OpenCL CPU runtime under the
emulation layer, on the family checks' tiny random-weight Llama 3 (2 layers, 8 query and 2 KV
heads of 32 dims). Oracle: the CPU op's greedy tokens, KV bytes and tokens held per head (the
openvino engine on CPU, the same method, budget, KV precision and block size)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import batched_beside_decoding, teacher_forced

from ov_kvcrush.config import CompressionConfig, GenerationSettings

BLOCK, NEW_TOKENS = 16, 5
#: (budget, sinks and recent tokens, options): the paper's one threshold over every layer and
#: head, in chunks of about 64 tokens (a 300-token prompt: several steps, a later one repeating
#: its predecessor's last tokens); the budget shared in each layer; a recent window beside the sinks
CASES = [
    (24, {}, {"chunk_tokens": 64, "step_multiple": 1, "slack_tokens": 0}),
    (24, {}, {"chunk_tokens": 64, "step_multiple": 1, "slack_tokens": 0, "allocation": "layer"}),
    (40, {"sink_tokens": 2, "recent_tokens": 6}, {"chunk_tokens": 128, "step_multiple": 1, "slack_tokens": 0}),
]


def _compression(budget: int, window: dict, options: dict) -> CompressionConfig:
    return CompressionConfig(method="kvzip", budget=budget, options=options, **window)


def _kvzip(model_dir: str, ids: list[int], device: str) -> list[tuple]:
    """Each case's greedy tokens, KV bytes and tokens held per layer and head after the prompt's
    scoring pass; then a chat of two turns (the second's pass over the turn's tokens alone, the
    heads keeping different counts before it) with the first case."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    engine = OpenVINOEngine(model_dir, device=device, kv_precision="f32", block_size=BLOCK, properties=F32)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out: list[tuple] = []
    try:
        for case in CASES:
            engine.set_compression(_compression(*case))
            res = engine.batcher.run(ids, settings, None)
            out.append((list(res.token_ids), res.kv_bytes))
            engine.prefill(ids)  # the engine's own sequence: a prompt, then its pass
            engine.scoring_pass()
            out.append(engine.sequence.head_tokens().tolist())
            engine.cache.reset()
        engine.set_compression(_compression(*CASES[0]))
        engine.start_chat("You are terse.")
        for turn in ("Tell me about the weather, in a long sentence of many words. " * 12, "And tomorrow?"):
            res = engine.generate(turn, settings)
            out.append((list(res.token_ids), res.kv_bytes))
    finally:
        engine.close()
    return out


@pytest.mark.model
def test_kvzip_on_gpu_keeps_the_cpu_ops_tokens_and_heads(emulation_worker, tiny_llama3_ir):
    ids = [int(t) for t in np.random.default_rng(7).integers(10, 380, 300)]
    want = _kvzip(tiny_llama3_ir, ids, "CPU")
    got = emulation_worker.submit(_kvzip, tiny_llama3_ir, ids, "GPU").result(timeout=900)
    assert got == want
    held = np.array(want[1])
    assert held.sum() == CASES[0][0] * held.size and len(set(held.flatten())) > 1  # one threshold, uneven heads
    assert (np.array(want[3]).sum(axis=1) == CASES[1][0] * held.shape[1]).all()  # each layer its share


#: the batch: four prompts decoding together when a fifth arrives in chunks (prompt tokens each)
BATCH_PROMPTS = (150, 90, 121, 70, 110)
#: a step's tokens: a prompt goes in chunks of 32 beside four decoding sequences
STEP_TOKENS = 36


@pytest.mark.model
def test_kvzip_on_gpu_compresses_prompts_in_chunks_beside_decoding_sequences(emulation_worker, tiny_llama3_ir):
    """Each prompt's scoring pass runs after its last chunk while the other sequences are
    decoding: every request's tokens on the GPU and on the CPU op equal its prompt's alone and
    whole on the CPU op."""
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(10, 380, n)] for n in BATCH_PROMPTS]
    args = (_compression(*CASES[0]), BLOCK, NEW_TOKENS, STEP_TOKENS)
    cpu = batched_beside_decoding(tiny_llama3_ir, prompts, "CPU", *args)
    got = emulation_worker.submit(batched_beside_decoding, tiny_llama3_ir, prompts, "GPU", *args, False).result(
        timeout=900
    )
    assert got[0] == cpu[0] == cpu[1]  # the GPU together, the CPU op together and whole
    for stats in (cpu[2], got[2]):  # each prompt's pass after its last chunk, the prompts in chunks
        assert stats["scoring_passes"] == len(prompts) and stats["prefill_chunks"] > len(prompts)


def _scoring_pass(engine) -> None:
    assert engine.scoring_pass() > 0  # the prompt is over the budget and its slack


def _teacher_forced(model_dir: str, ids: list[int], forced: list[int], device: str, properties: dict) -> list:
    """Each case's logits after ``ids`` then its scoring pass, and after each token of ``forced``
    fed in turn over the compressed cache (:func:`helpers.teacher_forced`)."""
    compressions = [_compression(*c) for c in CASES]
    return teacher_forced(model_dir, ids, forced, device, properties, compressions, BLOCK, _scoring_pass)


#: the largest logit error allowed of the GPU in f16 (its default) against the CPU op in f32,
#: relative to the largest logit, at the prompt's row: half precision's rounding of the
#: activations, as test_gpu_plugin_model's; measured 2.0e-3 (2026-11-30)
F16_TOLERANCE = 1e-2
#: the same at the rows after the scoring pass: which tokens pass the one threshold is decided by
#: scores that f16 reorders where two are close (on random weights nearly every one is: the
#: reconstruction's attention is near uniform), and another token kept moves the logits.
#: Measured 5.4e-2 to 7.0e-2 under the one threshold over every layer and head, 1.9e-3 with a
#: threshold a layer (2026-11-30); at f32 inference with the same f16 store, at most 3e-4. The
#: ClusterKV recall's bound in test_gpu_plugin_model is 0.15, for the same reason
SELECTION_F16_TOLERANCE = 0.15


@pytest.mark.model
def test_kvzip_on_gpu_in_f16_keeps_the_cpu_ops_f32_logits_within_tolerance(emulation_worker, tiny_llama3_ir):
    """The plugin in f16, our layers in f16: teacher-forced, every case's logits stay within
    :data:`F16_TOLERANCE` of the CPU op's in f32 at the prompt's row, and within
    :data:`SELECTION_F16_TOLERANCE` over the cache its scoring pass compressed."""
    from ov_kvcrush.tools.model_coverage import F32

    rng = np.random.default_rng(5)
    ids = [int(t) for t in rng.integers(10, 380, 300)]
    forced = [int(t) for t in rng.integers(10, 380, NEW_TOKENS)]
    want = _teacher_forced(tiny_llama3_ir, ids, forced, "CPU", F32)
    got = emulation_worker.submit(_teacher_forced, tiny_llama3_ir, ids, forced, "GPU", {}).result(timeout=900)
    for case, a, b in zip(CASES, got, want, strict=True):
        errors = np.abs(a - b).max(-1) / np.abs(b).max()
        assert errors[0] <= F16_TOLERANCE and (errors[1:] <= SELECTION_F16_TOLERANCE).all(), (case, errors)
        assert errors.max() > 0, case  # 0 would mean f32 ran
