"""``device="GPU"`` on Gemma 3 and Gemma 2: local (sliding-window) layers, and Gemma 2's attention
soft-capping. The tiny random-weight Gemma 3 of the family checks has a local layer of a 96-token
window then a global one. A local layer's row attends the last 96 slots up to its own (the prompt
layer compiled with the window), the layer gives back the blocks no later row sees, and the
method runs on the global layer alone, as the CPU op's rule (``attention_step.cpp``'s
``window``): a recall (ClusterKV, Quest) and a merge (Chelsea) too, the local layer's rows
recalling and merging nothing, and KVzip's scoring pass (the local layer attends its window and keeps
nothing of it). Run by the plugin on Intel's OpenCL CPU runtime
under the emulation layer; the prompts (past the window) go in chunks beside decoding sequences.
Oracle: the CPU op's greedy tokens (the openvino engine on CPU, the same method, budget, f32
blocks), together and each prompt alone and whole; for Quest, which the CPU op does not run, the
torch reference's. Gemma 2's tiny model (the same layers) is run with its cap lowered to 0.25 in
its exported folder's ``config.json`` (where the engines read it; the IR does not carry it), so
that the cap decides the tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import batched_beside_decoding, check_gpu_gives_cpu_ops_tokens, word_texts

from ov_kvcrush.config import CompressionConfig, GenerationSettings

BLOCK, NEW_TOKENS, STEP_TOKENS = 16, 5, 36
PROMPTS = (150, 90, 121, 70, 210)
#: the full cache (the local layer's window alone differs from a global layer), SnapKV evicting on
#: the global layer at each decode step past its budget, block-wise KVCrush
CASES = {
    "full": (None, {}, {}),
    "snapkv": (64, {"sink_tokens": 4, "recent_tokens": 8}, {}),
    "kvcrush": (64, {"sink_tokens": 4, "recent_tokens": 8}, {"block_size": BLOCK}),
    # MiniKV's 2-bit store on the global layer (its flush and attention there; the local layer reads
    # none), its pyramid's budget the first of one global layer's (the op's), not the second of two
    "minikv": (64, {"sink_tokens": 4, "recent_tokens": 8}, {"quant": {"residual_tokens": 16, "prompt_tail": 12}}),
    # ClusterKV's recall and Chelsea's merge, layers of the global layer alone (the local layer's
    # recall and merge rows do nothing), their new tokens clustered every 3 steps, merged every 4;
    # the global layer recalls (no dense layers: its logits are then off the full cache's)
    "clusterkv": (
        24,
        {"sink_tokens": 4},
        {"tokens_per_cluster": 4, "cluster_every": 3, "new_clusters": 2, "dense_layers": 0},
    ),
    "chelsea": (48, {"sink_tokens": 4, "recent_tokens": 8}, {"chunk_size": 16, "merge_interval": 4}),
    # KVzip's scoring pass through both layers (the local one attends its window and keeps nothing
    # of the pass), one threshold over the global layer's heads, chunks of 64
    "kvzip": (24, {}, {"chunk_tokens": 64, "step_multiple": 1, "slack_tokens": 0}),
}


def _held_after(model_dir: str, ids: list[int], forced: list[int]) -> tuple[list[int], int]:
    """On GPU, the full cache after ``ids`` and each token of ``forced``: each layer's slots held and
    the tokens seen."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    engine = OpenVINOEngine(model_dir, device="GPU", kv_precision="f32", block_size=BLOCK, properties=F32)
    try:
        engine.set_compression(CompressionConfig(method="full"))
        engine.prefill(ids)
        for t in forced:
            engine.forward([t])
        (sequence,) = engine.pool.sequences.values()
        return [c.layer.held for c in sequence.caches], sequence.seen
    finally:
        engine.close()


@pytest.mark.model
def test_on_gpu_a_local_layer_holds_its_window(emulation_worker, tiny_gemma3_ir):
    """After a 210-token prompt and 5 tokens, the local layer holds its window and less than a
    block more (the rest given back), the global layer every token."""
    rng = np.random.default_rng(3)
    ids, forced = [int(t) for t in rng.integers(10, 380, 210)], [int(t) for t in rng.integers(10, 380, 5)]
    held, seen = emulation_worker.submit(_held_after, tiny_gemma3_ir, ids, forced).result(timeout=900)
    window = 96  # the family's (ov_kvcrush.models.families.WINDOW)
    assert seen == 215 and held[1] == seen, held
    assert window - 1 <= held[0] <= window + BLOCK - 2, held  # (seen - window, seen] and the rest of its block


@pytest.mark.model
@pytest.mark.parametrize("method", list(CASES))
def test_on_gpu_a_local_layer_attends_its_window_with_the_cpu_ops_tokens(method, emulation_worker, tiny_gemma3_ir):
    budget, window, options = CASES[method]
    compression = CompressionConfig(method=method, budget=budget, options=options, **window)
    check_gpu_gives_cpu_ops_tokens(emulation_worker, tiny_gemma3_ir, compression, PROMPTS, 13, BLOCK, NEW_TOKENS,
                                   STEP_TOKENS)  # fmt: skip


def _capped_copy(model_dir: str, folder: Path, cap: float) -> str:
    """``model_dir`` copied into ``folder`` with its attention soft-capping set to ``cap``."""
    out = folder / Path(model_dir).name
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["attn_logit_softcapping"] = cap
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.model
def test_on_gpu_gemma2s_soft_capped_logits_give_the_cpu_ops_tokens(emulation_worker, tiny_gemma2_ir, tmp_path):
    """SnapKV on Gemma 2 with a cap of 0.25 (the layers' logits, and the prompt's window scores the
    selection takes, capped): the GPU's tokens are the CPU op's, and not those of the cap of 50."""
    capped = _capped_copy(tiny_gemma2_ir, tmp_path, 0.25)
    budget, window, options = CASES["snapkv"]
    compression = CompressionConfig(method="snapkv", budget=budget, options=options, **window)
    check_gpu_gives_cpu_ops_tokens(emulation_worker, capped, compression, PROMPTS, 17, BLOCK, NEW_TOKENS,
                                   STEP_TOKENS)  # fmt: skip
    rng = np.random.default_rng(17)
    prompts = [[int(t) for t in rng.integers(10, 380, n)] for n in PROMPTS]
    args = (compression, BLOCK, NEW_TOKENS, STEP_TOKENS, False)
    assert (
        batched_beside_decoding(capped, prompts, "CPU", *args)[0]
        != batched_beside_decoding(tiny_gemma2_ir, prompts, "CPU", *args)[0]
    )  # the cap of 0.25 decides the tokens


#: Quest beside the local layer: pages of 8 on the global layer (none dense), 32 slots a row
QUEST = CompressionConfig(method="quest", budget=32, options={"page_size": 8, "dense_layers": 0})


def _reference(checkpoint: str, texts: list[str]) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each text's ids, and Quest's, then the full cache's, greedy tokens for each by the torch
    reference (its local layer a window cache, the method on the global one)."""
    from ov_kvcrush.engines.torch_engine import TorchEngine

    engine = TorchEngine(checkpoint)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = []
    for compression in (QUEST, CompressionConfig(method="full")):
        engine.set_compression(compression)
        out.append([list(engine.generate(text, settings).token_ids) for text in texts])
    return [engine.encode(text) for text in texts], out


@pytest.mark.model
def test_on_gpu_quest_beside_a_local_layer_gives_the_references_tokens(emulation_worker, tiny_gemma3_ir):
    """Quest's pages layer on the global layer alone (the local layer attends its window): the
    GPU's tokens, four texts decoding while a fifth goes in chunks, are the torch reference's
    (the CPU op runs no Quest), which the pages change (the full cache's differ)."""
    from ov_kvcrush.models.families import tiny_checkpoint

    texts = word_texts((110, 70, 95, 60, 85))
    ids, (quest, full) = _reference(str(tiny_checkpoint("gemma3")), texts)
    args = (QUEST, BLOCK, NEW_TOKENS, STEP_TOKENS, False)
    got, _, stats = emulation_worker.submit(batched_beside_decoding, tiny_gemma3_ir, ids, "GPU", *args).result(
        timeout=900
    )
    assert got == quest
    assert stats["prefill_chunks"] > len(texts)
    assert quest != full
