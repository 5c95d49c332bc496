"""The torch engine end to end on the embedded model (SmolLM2-135M, CPU).

Oracles: plain transformers generation (no custom cache), the ``full`` method, and the cache's
tensors measured from their storage.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_main

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.hf_cache import storage_bytes
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.methods import REGISTRY

pytestmark = pytest.mark.model

QUESTION = "Write a short story about a robot who learns to paint. Use at least three sentences."
PASSKEY_TOKENS = 1500
BUDGET = 256


@pytest.fixture(scope="module")
def engine(hf_dir):
    from ov_kvcrush.engines.torch_engine import TorchEngine

    return TorchEngine(hf_dir, keep_cache=True)


@pytest.fixture(scope="module")
def passkey(engine):
    from ov_kvcrush.eval.tasks import passkey_prompt

    return passkey_prompt(PASSKEY_TOKENS, lambda t: len(engine.encode(t)), seed=3)


def _run(engine, compression: CompressionConfig, prompt, **settings):
    engine.set_compression(compression)
    return engine.generate(prompt, GenerationSettings(**settings))


@pytest.mark.slow
def test_full_equals_plain_transformers_for_32_greedy_tokens(engine, hf_dir):
    from ov_kvcrush.engines.torch_model import load_model

    plain, _ = load_model(hf_dir, attn="sdpa")  # transformers' own attention and DynamicCache
    ids = engine.encode(QUESTION)
    with torch.inference_mode():
        out = plain.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
    expected = [t for t in out[0, len(ids) :].tolist()]
    if 2 in expected:
        expected = expected[: expected.index(2)]
    r = _run(engine, CompressionConfig(), QUESTION, max_new_tokens=32)
    assert len(expected) == 32, "the prompt must make the model talk for 32 tokens"
    assert r.token_ids == expected
    assert r.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert r.prompt_tokens == len(ids) and r.ttft_ms > 0 and r.tpot_ms > 0


@pytest.fixture(scope="module")
def full_question(engine):
    """``full``'s 24 greedy tokens for QUESTION: every method at a budget above them must give these."""
    return _run(engine, CompressionConfig(), QUESTION, max_new_tokens=24)


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in REGISTRY if m != "full"])
def test_budget_above_the_sequence_gives_the_full_tokens(engine, full_question, method):
    """Every method, at a budget that holds the whole sequence, generates exactly what ``full`` does.

    MiniKV's 2-bit store is lossy by design whatever the budget; with a residual window longer
    than the sequence nothing gets quantized, so it must match too (its lossy path is checked in
    the passkey test and the method tests).
    """
    from ov_kvcrush.methods import QuantSettings

    full = full_question
    opts = {"quant": QuantSettings(residual_tokens=512)} if method == "minikv" else {}
    budget = 4 * (full.prompt_tokens + 24)  # pyramids give the top layer a quarter of the average
    r = _run(engine, CompressionConfig(method=method, budget=budget, options=opts), QUESTION, max_new_tokens=24)
    assert r.token_ids == full.token_ids
    assert not r.counters.get("evicted") and not r.counters.get("merges")


COMPRESSING = ["streamingllm", "h2o", "snapkv", "pyramidkv", "kvcrush", "chelsea", "minikv", "h2o+2bit"]


PASSKEY_METHODS = [*COMPRESSING, "clusterkv", "quest"]


def passkey_config(method: str) -> CompressionConfig:
    name, quant = (method[:-5], True) if method.endswith("+2bit") else (method, False)
    return CompressionConfig(method=name, budget=BUDGET, options={"quant": True} if quant else {})


@pytest.fixture(scope="module")
def passkey_runs(engine, passkey):
    """Every method's generation on the passkey prompt and the cache it held, the prompt's forward
    pass shared (``generate_each``: each result is that of ``generate`` under its compression)."""
    configs = [passkey_config(m) for m in PASSKEY_METHODS]
    results = engine.generate_each(passkey.prompt, configs, GenerationSettings(max_new_tokens=12))
    return dict(zip(PASSKEY_METHODS, zip(results, engine.last_caches, strict=True), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("method", PASSKEY_METHODS)
def test_passkey_at_budget_256_memory_is_real(passkey_runs, method):
    """~1.5k-token passkey prompt at budget 256: eviction/merging methods hold <= 25 % of the full
    cache (<= 1/8 with the 2-bit store), and the reported bytes are the bytes of the tensors held."""
    name, quant = (method[:-5], True) if method.endswith("+2bit") else (method, False)
    r, cache = passkey_runs[method]
    assert PASSKEY_TOKENS - 50 <= r.prompt_tokens <= PASSKEY_TOKENS
    measured = storage_bytes(list(cache.method_layers()))
    assert measured == r.kv_bytes == cache.memory()["total"]
    assert r.counters["kv_payload_bytes"] + r.counters["kv_metadata_bytes"] == r.kv_bytes
    seen = r.counters["tokens_seen"]
    assert r.full_kv_bytes == 30 * 2 * 3 * seen * 64 * 4  # layers x K,V x kv heads x tokens x dim x fp32
    if name in ("clusterkv", "quest"):
        # recall methods keep every token and attend to the budget each step (ClusterKV also
        # attends the generated tokens not clustered yet)
        assert r.kv_bytes >= r.full_kv_bytes
        for lc in list(cache.method_layers())[2:]:  # past the dense layers
            assert int(lc.tokens_attended().max()) <= BUDGET + r.generated_tokens
        return
    limit = 1 / 8 if quant or name == "minikv" else 0.25
    assert r.kv_bytes <= limit * r.full_kv_bytes, f"{method}: {r.kv_ratio:.3f} of full"
    assert r.peak_kv_bytes >= r.kv_bytes


@pytest.mark.slow
def test_full_cache_finds_the_passkey(engine, passkey):
    r = _run(engine, CompressionConfig(), passkey.prompt, max_new_tokens=12)
    assert passkey.score(r.text) == 1.0, r.text
    assert storage_bytes(list(engine.last_cache.method_layers())) == r.kv_bytes


@pytest.mark.slow
def test_clusterkv_recall_cache_changes_cost_never_results(engine, passkey):
    runs = {}
    for steps in (0, 1):
        cfg = CompressionConfig(method="clusterkv", budget=BUDGET, options={"recall_cache_steps": steps})
        runs[steps] = _run(engine, cfg, passkey.prompt, max_new_tokens=12)
    assert runs[0].token_ids == runs[1].token_ids
    for r in runs.values():
        assert 0.0 <= r.counters["hit_rate"] <= 1.0
    assert runs[0].counters["hit_rate"] == 0.0 and runs[1].counters["hit_rate"] > 0.0
    assert runs[1].counters["tokens_loaded"] < runs[0].counters["tokens_loaded"]


def test_recall_rate_is_reported_when_asked(engine):
    cfg = CompressionConfig(method="clusterkv", budget=80, options={"track_recall": True, "tokens_per_cluster": 16})
    r = _run(engine, cfg, QUESTION, max_new_tokens=4)
    assert 0.0 < r.counters["recall_rate"] <= 1.0


def test_torch_and_genai_tokenize_the_chat_prompt_alike(engine, full_engine):
    for prompt in (QUESTION, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]):
        assert engine.encode(prompt) == full_engine.encode(prompt)
    assert engine.encode("plain text", apply_chat_template=False) == full_engine.encode("plain text", False)


@pytest.mark.slow
def test_sampling_is_seeded_and_streamer_sees_the_text(engine):
    cfg = CompressionConfig(method="h2o", budget=128)
    a = _run(engine, cfg, QUESTION, max_new_tokens=16, do_sample=True, seed=1, temperature=0.9, top_p=0.9)
    b = _run(engine, cfg, QUESTION, max_new_tokens=16, do_sample=True, seed=1, temperature=0.9, top_p=0.9)
    c = _run(engine, cfg, QUESTION, max_new_tokens=16, do_sample=True, seed=2, temperature=1.5, top_k=50)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    chunks: list[str] = []
    engine.set_compression(CompressionConfig())
    r = engine.generate(QUESTION, GenerationSettings(max_new_tokens=16), streamer=lambda s: chunks.append(s))
    assert "".join(chunks) == r.text
    stopped = engine.generate(QUESTION, GenerationSettings(max_new_tokens=16), streamer=lambda s: True)
    assert stopped.generated_tokens == 1


def test_pipeline_facade_mirrors_genai(hf_dir):
    from ov_kvcrush import LLMPipeline

    pipe = LLMPipeline(hf_dir, "CPU", backend="torch", compression="snapkv", budget=128)
    out = pipe.generate("Name a colour.", max_new_tokens=8)
    assert str(out) == out.text and out.backend == "torch" and out.method == "snapkv"
    many = pipe.generate(["Name a colour.", "Name a fruit."], GenerationSettings(max_new_tokens=4))
    assert len(many) == 2 and many[0].text == pipe.generate("Name a colour.", max_new_tokens=4).text
    with pytest.raises(ConfigError, match="max_tokens"):
        pipe.generate("x", max_tokens=3)
    with pytest.raises(UserError, match="IR directory"):
        from ov_kvcrush.models.export import ensure_default_model

        LLMPipeline(ensure_default_model(progress=False), backend="torch")


def test_bad_device_and_dtype_are_named(hf_dir):
    from ov_kvcrush.engines.torch_engine import TorchEngine

    with pytest.raises(ConfigError, match="device="):
        TorchEngine(hf_dir, device="tpu")
    with pytest.raises(ConfigError, match="dtype="):
        TorchEngine(hf_dir, dtype="int4")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA"):
            TorchEngine(hf_dir, device="cuda")


@pytest.mark.slow
def test_cli_generate_torch_writes_json(tmp_path, capsys):
    """Through the entry point's ``main`` (a fresh interpreter's start: test_user_errors, test_demo)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("What is the capital of France?")
    out = tmp_path / "r.json"
    code, stdout, stderr = run_main(
        capsys,
        "generate", "--backend", "torch", "--method", "kvcrush", "--budget", "128", "--option", "representatives=16",
        "--prompt-file", str(prompt), "--max-new-tokens", "8", "--json", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    data = json.loads(out.read_text())
    for key in ("text", "ttft_ms", "tpot_ms", "kv_bytes", "full_kv_bytes", "method", "budget", "backend"):
        assert key in data
    assert data["backend"] == "torch" and data["method"] == "kvcrush" and data["budget"] == 128
    assert data["text"].strip() and data["text"].strip() in stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--method", "chelsea"], "budget=None is invalid"),
        (["--method", "kvcrush", "--budget", "256", "--option", "bogus=1"], "bogus=1 is invalid"),
        (["--method", "kvcrush", "--budget", "256", "--option", "noequals"], "KEY=VALUE"),
        (["--method", "chelsea", "--budget", "256", "--device", "tpu"], "device='tpu' is invalid"),
    ],
)
def test_cli_generate_torch_errors_are_one_line(tmp_path, capsys, args, needle):
    """Through the entry point's ``main`` (test_user_errors runs such refusals in a fresh interpreter)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    code, _, err = run_main(capsys, "generate", "--backend", "torch", "--prompt-file", str(prompt), *args)
    assert code == 2 and needle in err and "Traceback" not in err
