"""Batched generation on the torch engine (issue 52): several sequences decode in one step, each
with its own method state. Oracle: the same engine generating each prompt alone.

On CPU the engine's fast layers select and attend with tensor operations (their Triton kernels,
interpreted, cost about a second a decode step of this tiny model); the kernels themselves take a
batch layer by layer in Triton's interpreter below, and compiled, with CUDA graphs, in the CUDA
test where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.base import equal_length_groups
from ov_kvcrush.engines.hf_baseline import HFBaselineEngine
from ov_kvcrush.engines.torch_engine import TorchEngine
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.fastpath import fast_layer
from ov_kvcrush.kernels import interpreting, triton_importable
from ov_kvcrush.methods import ClusterKVConfig, MiniKVConfig, QuantSettings, QuestConfig

TINY = "random:tiny-llama"
#: three prompts of one byte count (one batch; the byte tokenizer: a token per byte) and one longer
PROMPTS = [
    "The pass key is 52445. Remember it. " * 4 + "What is the pass key?",
    "The pass key is 90210. Keep it safe " * 4 + "What is the pass key?",
    "A quiet harbour at dawn, gulls fly. " * 4 + "What is the pass key?",
    "The pass key is 11111. Remember it!! " * 5 + "What is the pass key?",
]
GREEDY = GenerationSettings(max_new_tokens=16, ignore_eos=True)
#: the fast path's methods, at budgets under the prompts; ClusterKV clusters new tokens every 8 steps
FAST = {
    "full": CompressionConfig(),
    "clusterkv": CompressionConfig("clusterkv", budget=96, options={"cluster_every": 8, "tokens_per_cluster": 16}),
    "quest": CompressionConfig("quest", budget=64, options={"page_size": 16}),
    "snapkv": CompressionConfig("snapkv", budget=96),
    "minikv": CompressionConfig("minikv", budget=96),
}


def test_prompts_group_by_length_in_order_of_appearance():
    assert equal_length_groups([[1, 2], [3], [4, 5], [6], [7, 8, 9]]) == [[0, 2], [1, 3], [4]]


@pytest.mark.parametrize("name", list(FAST))
def test_a_batch_generates_what_each_prompt_generates_alone(name):
    """Greedy tokens of the fast path in a batch of three equal-length prompts and one longer
    prompt equal one-at-a-time runs; each result is its prompt's."""
    engine = TorchEngine(TINY, FAST[name], fast_path=True)
    assert len({len(engine.encode(p)) for p in PROMPTS[:3]}) == 1 and len(engine.encode(PROMPTS[3])) > len(
        engine.encode(PROMPTS[0])
    )
    batch = engine.generate_batch(PROMPTS, GREEDY)
    alone = [engine.generate(p, GREEDY) for p in PROMPTS]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in batch}) > 1  # the rows differ: no row answered for another
    assert [r.prompt_tokens for r in batch] == [r.prompt_tokens for r in alone]
    rows = batch[0].counters["batch_rows"]
    assert rows == 3 and "batch_rows" not in batch[3].counters
    # a row's share of the batch's cache is what it holds alone (the same shapes; store capacity rounds)
    assert batch[0].kv_bytes == pytest.approx(alone[0].kv_bytes, rel=0.02)
    assert batch[0].counters["kv_read_bytes"] == pytest.approx(rows * alone[0].counters["kv_read_bytes"], rel=0.02)


def test_a_sampled_batch_draws_each_row_as_alone():
    settings = GenerationSettings(max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=7)
    engine = TorchEngine(TINY, FAST["clusterkv"], fast_path=True)
    batch = engine.generate_batch(PROMPTS[:3], settings)
    assert [r.token_ids for r in batch] == [engine.generate(p, settings).token_ids for p in PROMPTS[:3]]


def test_the_reference_and_a_scoring_pass_batch_too():
    """Without the fast path every layer is the reference (the oracle batches as well), and a
    method with a scoring pass (KVzip) runs its prompts one at a time: the same tokens."""
    for comp in (CompressionConfig("kvcrush", budget=96), CompressionConfig("kvzip", budget=96)):
        engine = TorchEngine(TINY, comp)
        batch = engine.generate_batch(PROMPTS[:2], GREEDY)
        assert [r.token_ids for r in batch] == [engine.generate(p, GREEDY).token_ids for p in PROMPTS[:2]]


def test_transformers_batches_equal_its_single_runs():
    sdpa = HFBaselineEngine(TINY, backend="hf-sdpa")
    batch = sdpa.generate_batch(PROMPTS, GREEDY)
    assert [r.token_ids for r in batch] == [sdpa.generate(p, GREEDY).token_ids for p in PROMPTS]
    # and our full cache in a batch answers what transformers does
    ours = TorchEngine(TINY).generate_batch(PROMPTS, GREEDY)
    assert [r.token_ids for r in ours] == [r.token_ids for r in batch]
    # a step of either reads every row's cache: the bench's floor counts the batch's bytes
    for engine_rows in (batch, ours):
        assert engine_rows[0].counters["batch_rows"] == 3 and "batch_rows" not in engine_rows[3].counters
    assert batch[0].counters["kv_read_bytes"] == 3 * batch[0].kv_bytes
    assert batch[3].counters["kv_read_bytes"] == batch[3].kv_bytes
    # the same tokens (ours counts its store's reserve, rounded up)
    assert batch[0].counters["kv_read_bytes"] == pytest.approx(ours[0].counters["kv_read_bytes"], rel=0.1)


#: one layer of each method whose decode runs Triton kernels (layer 2 of 3: not a dense layer)
KERNEL_LAYERS = {
    "clusterkv": ClusterKVConfig(budget=40, sink_tokens=4, tokens_per_cluster=10, cluster_every=6),
    "quest": QuestConfig(budget=32, page_size=8),
    "minikv": MiniKVConfig(budget=48, sink_tokens=4, recent_tokens=8, quant=QuantSettings(residual_tokens=16)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNEL_LAYERS))
def test_fused_kernels_attend_each_row_of_a_batch_as_alone(monkeypatch, name):
    """The fused selection (ClusterKV's ranking and placement), the split-key decode attention
    and the 2-bit store's kernel, interpreted, over a layer holding three sequences: each row's
    output and attended tokens equal a layer holding that sequence alone, step by step."""
    if not (triton_importable() and interpreting()):
        pytest.skip("needs Triton's interpreter")
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", "triton")
    config = KERNEL_LAYERS[name]
    gen = torch.Generator().manual_seed(11)
    qkv = lambda t: [torch.randn(3, h, t, 16, generator=gen) for h in (4, 2, 2)]  # noqa: E731
    batch, alone = fast_layer(config, 2, 3, reserve=20), [fast_layer(config, 2, 3, reserve=20) for _ in range(3)]
    prompt = qkv(70)
    outs = [batch.prefill(*prompt), *(layer.prefill(*(x[i : i + 1] for x in prompt)) for i, layer in enumerate(alone))]
    assert torch.allclose(outs[0], torch.cat(outs[1:]), atol=1e-5)
    for step in range(14):
        x = qkv(1)
        got = batch.decode(*x)
        for i, layer in enumerate(alone):
            assert torch.allclose(got[i : i + 1], layer.decode(*(t[i : i + 1] for t in x)), atol=1e-5), (step, i)
            if name != "minikv":
                assert torch.equal(batch.last_selected[i : i + 1], layer.last_selected), (step, i)
    if name == "clusterkv":
        assert batch.fused_slots is not None and batch.counters["clusterings"] >= 3


@pytest.mark.parametrize("bad", [[], "one prompt", None])
def test_a_batch_needs_a_list_of_prompts(bad):
    engine = TorchEngine(TINY)
    with pytest.raises(ConfigError, match="prompts"):
        engine.generate_batch(bad, GREEDY)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(FAST))
def test_cuda_graphed_batches_generate_what_each_prompt_generates_alone(name):
    engine = TorchEngine(TINY, FAST[name], device="cuda")
    batch = engine.generate_batch(PROMPTS, GREEDY)
    assert batch[0].counters["graph_captures"] >= 1
    assert [r.token_ids for r in batch] == [engine.generate(p, GREEDY).token_ids for p in PROMPTS]
