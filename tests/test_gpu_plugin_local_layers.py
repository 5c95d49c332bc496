"""``device="GPU"`` on a model with local (sliding-window) layers: the tiny random-weight Gemma 3
of the family checks, a local layer of a 96-token window then a global one. A local layer's row
attends the last 96 slots up to its own (the prompt layer compiled with the window), the layer
gives back the blocks no later row sees, and the method runs on the global layer alone, as the CPU
op's rule (``attention_step.cpp``'s ``window``). Run by the plugin on Intel's OpenCL CPU runtime
under the emulation layer; the prompts (past the window) go in chunks beside decoding sequences.
Oracle: the CPU op's greedy tokens (the openvino engine on CPU, the same method, budget, f32
blocks), together and each prompt alone and whole."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_gpu_gives_cpu_ops_tokens

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.errors import UserError

BLOCK, NEW_TOKENS, STEP_TOKENS = 16, 5, 36
PROMPTS = (150, 90, 121, 70, 210)
#: the full cache (the local layer's window alone differs from a global layer), SnapKV evicting on
#: the global layer at each decode step past its budget, block-wise KVCrush
CASES = {
    "full": (None, {}, {}),
    "snapkv": (64, {"sink_tokens": 4, "recent_tokens": 8}, {}),
    "kvcrush": (64, {"sink_tokens": 4, "recent_tokens": 8}, {"block_size": BLOCK}),
}


def _held_after(model_dir: str, ids: list[int], forced: list[int]) -> tuple[list[int], int, str]:
    """On GPU, the full cache after ``ids`` and each token of ``forced``: each layer's slots held and
    the tokens seen; and what ClusterKV's compression over the model is answered with."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    engine = OpenVINOEngine(model_dir, device="GPU", kv_precision="f32", block_size=BLOCK, properties=F32)
    try:
        engine.set_compression(CompressionConfig(method="full"))
        engine.prefill(ids)
        for t in forced:
            engine.forward([t])
        (sequence,) = engine.pool.sequences.values()
        held = [c.layer.held for c in sequence.caches]
        try:
            engine.set_compression(CompressionConfig(method="clusterkv", budget=48, sink_tokens=4))
            refusal = ""
        except UserError as exc:
            refusal = str(exc)
        return held, sequence.seen, refusal
    finally:
        engine.close()


@pytest.mark.model
def test_on_gpu_a_local_layer_holds_its_window_and_a_recall_is_refused(emulation_worker, tiny_gemma3_ir):
    """After a 210-token prompt and 5 tokens, the local layer holds its window and less than a
    block more (the rest given back), the global layer every token; ClusterKV, whose recall is a
    layer of each layer's, is refused by name beside local layers."""
    rng = np.random.default_rng(3)
    ids, forced = [int(t) for t in rng.integers(10, 380, 210)], [int(t) for t in rng.integers(10, 380, 5)]
    held, seen, refusal = emulation_worker.submit(_held_after, tiny_gemma3_ir, ids, forced).result(timeout=900)
    window = 96  # the family's (ov_kvcrush.models.families.WINDOW)
    assert seen == 215 and held[1] == seen, held
    assert window - 1 <= held[0] <= window + BLOCK - 2, held  # (seen - window, seen] and the rest of its block
    assert "clusterkv" in refusal and "local" in refusal, refusal


@pytest.mark.model
@pytest.mark.parametrize("method", list(CASES))
def test_on_gpu_a_local_layer_attends_its_window_with_the_cpu_ops_tokens(method, emulation_worker, tiny_gemma3_ir):
    budget, window, options = CASES[method]
    compression = CompressionConfig(method=method, budget=budget, options=options, **window)
    check_gpu_gives_cpu_ops_tokens(emulation_worker, tiny_gemma3_ir, compression, PROMPTS, 13, BLOCK, NEW_TOKENS,
                                   STEP_TOKENS)  # fmt: skip
