"""Random-weight architectures and the transformers baselines: the GPU benchmark's shapes, run small on CPU.

Oracle: transformers itself (``hf-sdpa``: ``model.generate`` with sdpa and DynamicCache) on the
same seeded weights.
"""

from __future__ import annotations

import pytest
import torch
from helpers import bench_script_dry_run

from ov_kvcrush import bench
from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.hf_baseline import HFBaselineEngine
from ov_kvcrush.engines.random_model import ARCHITECTURES, byte_tokenizer, random_config
from ov_kvcrush.engines.torch_engine import TorchEngine
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.serving.backends import resolve_model

TINY = "random:tiny-llama"
PROMPT = "The pass key is 52445. Remember it. " * 6 + "What is the pass key?"
GREEDY = GenerationSettings(max_new_tokens=12, ignore_eos=True)


def test_an_unknown_architecture_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match="llama-3-8b"):
        random_config("random:llama-9")
    with pytest.raises(ConfigError, match="random weights run on torch only"):
        resolve_model("genai", TINY)
    assert resolve_model("torch", TINY) == TINY
    cfg = random_config("random:llama-3-8b")
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 32, 8, 128)
    assert set(ARCHITECTURES) >= {"llama-3-8b", "tiny-llama"}


def test_the_byte_tokenizer_counts_bytes_and_round_trips():
    tok = byte_tokenizer()
    text = "Naïve café: 3.14 — done.\n\tEnd"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode())
    assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def sdpa():
    return HFBaselineEngine(TINY, backend="hf-sdpa")


def test_torch_full_equals_transformers_on_random_weights(sdpa):
    want = sdpa.generate(PROMPT, GREEDY)
    got = TorchEngine(TINY).generate(PROMPT, GREEDY)
    assert len(want.token_ids) == 12 and got.token_ids == want.token_ids
    assert want.kv_bytes == got.full_kv_bytes  # the DynamicCache's bytes for the same tokens


def test_fast_clusterkv_with_a_budget_over_the_prompt_equals_transformers(sdpa):
    engine = TorchEngine(TINY, CompressionConfig("clusterkv", budget=4096), fast_path=True)
    got = engine.generate(PROMPT, GREEDY)
    assert got.token_ids == sdpa.generate(PROMPT, GREEDY).token_ids
    assert got.counters["clusterings"] > 0 and got.counters["clustering_prefill_ms"] > 0


def test_the_compiled_static_baseline_needs_cuda():
    with pytest.raises(ConfigError, match=r"device.*cuda"):
        HFBaselineEngine(TINY, backend="hf-static-compiled")
    with pytest.raises(ConfigError, match="method"):
        HFBaselineEngine(TINY, CompressionConfig("snapkv", budget=128))
    plan = bench.BenchPlan(backends=("torch", "hf-static-compiled"), methods=("full",), model=TINY, lengths=(256,))
    with pytest.raises(ConfigError, match="hf-static-compiled"):
        bench.dry_run(plan)
    with pytest.raises(ConfigError, match="backends"):
        bench.dry_run(bench.BenchPlan(backends=("genai", "torch"), model=TINY, lengths=(256,)))


def test_bench_on_random_weights_is_speed_only_and_anchored_on_transformers():
    plan = bench.BenchPlan(
        backends=("torch", "hf-sdpa"),
        methods=("full", "clusterkv"),
        budgets=(128,),
        lengths=(256,),
        repeats=1,
        new_tokens=4,
        model=TINY,
        isolate=False,
    )
    doc = bench.run_bench(plan)
    bench.validate_doc(doc)
    assert doc["anchor"] == "hf-sdpa full" and doc["speed_only"] is True
    rows = {r["label"]: r for r in doc["results"]}
    assert set(rows) == {"hf-sdpa full", "torch full", "torch clusterkv @128"}
    assert rows["hf-sdpa full"]["tpot_vs_anchor"] == 1.0 and rows["hf-sdpa full"]["ttft_vs_anchor"] == 1.0
    assert all(r["correct"] is None and r["tpot_vs_native_full"] is None for r in rows.values())
    assert rows["torch clusterkv @128"]["ttft_vs_anchor"] > 0
    assert "speed only" in bench.format_markdown(doc)


def test_engines_in_one_process_share_one_random_model():
    a, b = TorchEngine(TINY), TorchEngine(TINY, CompressionConfig("clusterkv", budget=256))
    assert a.model is b.model  # the bench's --no-isolate GPU run holds the weights once
    assert HFBaselineEngine(TINY).model is not a.model  # another attention implementation


@pytest.mark.slow
@pytest.mark.parametrize("run", ["main", "long", "headline", "batch", "ours"])
def test_the_gpu_benchmark_command_plans(run):
    """`benchmarks/gpu.sh` (the committed GPU command) passes every check a real run makes; without
    a GPU the last check, the device, refuses it by name."""
    proc = bench_script_dry_run("gpu.sh", run)
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr
        assert "hf-sdpa full" in proc.stdout
    else:
        assert proc.returncode == 2 and "device='cuda' is invalid" in proc.stderr, proc.stderr
