"""Our layers in OpenVINO's GPU plugin are compiled for a few step shapes, not for each one
(``ov_kvcrush/gpu/step_shape.py``): the plugin writes every input's shape into a custom layer's
program, so a prompt of a length not seen before compiled every layer again. Counted by the
emulation layer (the programs made from source, ours apart: ``Counts.layer_programs``) on the tiny
random-weight Llama 3. Oracles: the program counts of a prompt of a new size (the counter counts),
and the CPU op's greedy tokens for each prompt (the padding changes nothing a sequence sees)."""

from __future__ import annotations

import numpy as np
import pytest

from ov_kvcrush.config import CompressionConfig, GenerationSettings

#: prompts of 150, 155 and 152 tokens are all shown as 160 (one size); 170 as 176 (the next)
PROMPTS = (150, 155, 170, 152)
NEW_TOKENS = 4


def _run(model_dir: str, device: str, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens through the full cache and then SnapKV on ``device``, one
    request at a time, and the layer programs made while it ran (0 off the emulation)."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    counting = device == "GPU"
    if counting:
        from ov_kvcrush.engines.gpu_plugin_model import forget_compilations
        from ov_kvcrush.gpu import emulation

        forget_compilations()  # compiled afresh: an earlier test's in this process showed these sizes
    engine = OpenVINOEngine(model_dir, device=device, kv_precision="f32", block_size=16, properties=F32)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = []
    try:
        snapkv = CompressionConfig(method="snapkv", budget=64, sink_tokens=4, recent_tokens=8)
        for compression in (CompressionConfig(), snapkv):
            engine.set_compression(compression)
            for ids in prompts:
                before = emulation.counts() if counting else None
                tokens = list(engine.batcher.run(ids, settings, None).token_ids)
                out.append((tokens, (emulation.counts() - before).layer_programs if counting else 0))
    finally:
        engine.close()
    return out


@pytest.mark.model
def test_a_prompt_of_a_size_already_shown_compiles_no_layer_and_keeps_the_cpu_ops_tokens(
    emulation_worker, tiny_llama3_ir
):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(10, 380, n)] for n in PROMPTS]
    want = _run(tiny_llama3_ir, "CPU", prompts)
    got = emulation_worker.submit(_run, tiny_llama3_ir, "GPU", prompts).result(timeout=900)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    programs = [n for _, n in got]
    n = len(PROMPTS)
    full, snapkv = programs[:n], programs[n:]
    assert full[0] > 0, programs  # the engine's first prompt
    for counts in (full, snapkv):
        # 155 after 150: both shown as 160; SnapKV's decode rows' logits buffer, which doubled in
        # the 150's decode steps, is shown at one shape whatever its size (BYTES_SHAPE)
        assert counts[1] == 0, programs
        assert counts[2] > 0, programs  # 170: a size not seen before (the count counts)
        assert counts[3] == 0, programs  # 152: shown as 160, as before


def _three_engines(model_dir: str, ids: list[int]) -> list[tuple[list[int], int]]:
    """``ids``' greedy tokens through three engines of the same model and settings on ``GPU``,
    one after another (the second while the first is open, the third after the process's
    compilations were let go), and the programs each made."""
    from ov_kvcrush.engines.gpu_plugin_model import forget_compilations
    from ov_kvcrush.gpu import emulation
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engines, out = [], []
    try:
        for i in range(3):
            if i == 2:
                forget_compilations()
            before = emulation.counts()
            engine = OpenVINOEngine(model_dir, device="GPU", kv_precision="f32", block_size=16, properties=F32)
            engines.append(engine)
            tokens = list(engine.batcher.run(ids, settings, None).token_ids)
            out.append((tokens, (emulation.counts() - before).programs))
    finally:
        for engine in engines:
            engine.close()
    return out


@pytest.mark.model
def test_a_second_engine_of_the_same_model_compiles_nothing(emulation_worker, tiny_llama3_ir):
    """Engines of one model, device and settings share its compilation (``PluginCompilation``):
    the second makes no program for a prompt the first ran, and gives its tokens; after
    ``forget_compilations`` a third compiles again (the count counts)."""
    ids = [int(t) for t in np.random.default_rng(5).integers(10, 380, 60)]
    (first, made), (second, made_second), (third, made_third) = emulation_worker.submit(
        _three_engines, tiny_llama3_ir, ids
    ).result(timeout=900)
    assert made > 0 and made_second == 0 and made_third > 0
    assert first == second == third
