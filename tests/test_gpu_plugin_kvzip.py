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

from ov_kvcrush.config import CompressionConfig, GenerationSettings

BLOCK, NEW_TOKENS = 16, 5
#: (budget, sinks and recent tokens, options): the paper's one threshold over every layer and head, in chunks of about 64
#: tokens (a 300-token prompt: several steps, a later one repeating its predecessor's last tokens);
#: the budget shared in each layer; a recent window beside the sinks
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
