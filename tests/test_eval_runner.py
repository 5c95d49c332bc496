"""The evaluation end to end on the embedded model: shared-prefill generation, teacher forcing, the CLI.

Oracles: the engine's own one-method ``generate`` (shared prefill must not change any token),
plain transformers' logits (teacher-forced perplexity), the methods' real caches (memory probe).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import run_main

from ov_kvcrush.config import CompressionConfig, GenerationSettings, MethodSpec
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.eval.budget import ModelShape, held_bytes

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(hf_dir):
    from ov_kvcrush.engines.torch_engine import TorchEngine

    return TorchEngine(hf_dir)


@pytest.fixture(scope="module")
def prompt(engine):
    from ov_kvcrush.eval.tasks import passkey_prompt

    return passkey_prompt(450, lambda t: len(engine.encode(t)), seed=11, depth=0.4).prompt


CONFIGS = [
    CompressionConfig(),
    CompressionConfig("h2o", 96),
    CompressionConfig("h2o", 160),  # a second H2O reuses the memoised prompt scores
    CompressionConfig("snapkv", 96),
    CompressionConfig("kvcrush", 128, options={"quant": True}),
    CompressionConfig("chelsea", 128),
    CompressionConfig("minikv", 128),
    CompressionConfig("clusterkv", 96, options={"track_recall": True}),
    CompressionConfig("quest", 96, options={"track_recall": True}),
]


@pytest.fixture(scope="module")
def shared(engine, prompt):
    return engine.generate_each(prompt, CONFIGS, GenerationSettings(max_new_tokens=8))


@pytest.mark.slow
def test_shared_prefill_gives_each_methods_own_tokens(engine, prompt, shared):
    for config, result in zip(CONFIGS, shared, strict=True):
        engine.set_compression(config)
        alone = engine.generate(prompt, GenerationSettings(max_new_tokens=8))
        assert result.token_ids == alone.token_ids, config
        assert result.kv_bytes == alone.kv_bytes
    for result in shared[-2:]:
        assert 0.0 < result.counters["recall_rate"] <= 1.0


@pytest.mark.slow
def test_memory_probe_equals_what_the_engine_held(engine, shared):
    shape = ModelShape.from_config(engine.model.config, engine.model.dtype)
    for config, result in zip(CONFIGS[1:], shared[1:], strict=True):
        steps = result.counters["tokens_seen"] - result.prompt_tokens
        probe_config = CompressionConfig(
            config.method, config.budget, options={k: v for k, v in config.options.items() if k != "track_recall"}
        )
        assert held_bytes(probe_config, shape, result.prompt_tokens, steps) == result.kv_bytes, config


@pytest.mark.slow
def test_teacher_forced_perplexity_equals_plain_transformers(engine, hf_dir):
    from ov_kvcrush.engines.torch_model import load_model

    ids = engine.tokenizer("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=True).input_ids
    context, continuation = ids[:-24], ids[-24:]
    scores = engine.score_continuation_each(
        context, continuation, [CompressionConfig(), CompressionConfig("snapkv", 4096), CompressionConfig("h2o", 96)]
    )
    plain, _ = load_model(hf_dir, attn="sdpa")
    with torch.inference_mode():
        logits = plain(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
    nll = -logp[torch.arange(len(continuation)), torch.tensor(continuation)]
    assert scores[0].nll == pytest.approx(nll.tolist(), abs=2e-3)
    assert scores[0].predicted == logits[len(context) - 1 : -1].argmax(-1).tolist()
    assert scores[0].perplexity == pytest.approx(math.exp(float(nll.mean())), rel=1e-3)
    assert scores[1].nll == pytest.approx(scores[0].nll, abs=2e-3)  # a budget above the length is lossless
    assert scores[2].kv_bytes < scores[0].kv_bytes / 4  # and a small one really holds less


@pytest.mark.slow
def test_cli_eval_writes_one_entry_per_combination(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code, out, err = run_main(
        capsys,
        "eval", "--tasks", "passkey,ppl", "--lengths", "400", "--methods", "snapkv,quest", "--budgets", "96,160",
        "--max-new-tokens", "12", "--ppl-tokens", "16", "--json", str(out_json), "--plot", str(out_png),
        "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out_json.read_text())
    combos = {(r["task"], r["length"], r["method"], r["budget"], r["backend"]) for r in data["results"]}
    expected = {("passkey", 400, "full", None, "torch"), ("ppl", 400, "full", None, "torch")} | {
        (t, 400, m, b, "torch") for t in ("passkey", "ppl") for m in ("snapkv", "quest") for b in (96, 160)
    }
    assert combos == expected and len(data["results"]) == len(expected)
    for r in data["results"]:
        assert {"score", "agreement", "kv_bytes", "full_kv_bytes", "n"} <= set(r) and r["n"] == 1
        if r["method"] == "full":
            assert r["agreement"] == 1.0
        if r["method"] == "quest":
            assert 0.0 <= r["recall_rate"] <= 1.0
        if r["method"] == "snapkv":
            assert r["kv_bytes"] < r["full_kv_bytes"] / 2
    ppl = [r for r in data["results"] if r["task"] == "ppl"]
    assert all(r["metric"] == "perplexity" and r["score"] > 1 for r in ppl)
    assert out_png.stat().st_size > 10_000
    assert "summary over accuracy tasks" in out and "passkey" in out
    assert data["meta"]["command"].startswith("ov-kvcrush eval --tasks passkey,ppl")


@pytest.mark.slow
def test_cli_eval_custom_data_and_equal_memory(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "What is the capital of France? Answer in one word.", "answers": ["Paris"]},
        {"prompt": "Repeat exactly this sentence: The password is swordfish.", "answers": ["swordfish"]},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out_json = tmp_path / "d.json"
    code, out, err = run_main(
        capsys, "eval", "--data", str(data), "--methods", "snapkv", "--budgets", "96", "--max-new-tokens", "12",
        "--json", str(out_json), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    res = json.loads(out_json.read_text())["results"]
    assert {(r["task"], r["length"], r["method"], r["n"]) for r in res} == {
        ("data", None, "full", 2),
        ("data", None, "snapkv", 2),
    }
    full = next(r for r in res if r["method"] == "full")
    assert full["score"] == 1.0  # the model knows both: the scorer finds the answers in real outputs

    out_json = tmp_path / "m.json"
    code, out, err = run_main(
        capsys, "eval", "--tasks", "passkey", "--lengths", "500", "--methods", "snapkv,snapkv+2bit,quest",
        "--kv-ratio", "0.35", "--max-new-tokens", "8", "--json", str(out_json), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out_json.read_text())
    chosen = {b["label"]: b for b in report["budgets"]}
    assert chosen["quest"]["status"] == "unreachable" and "quest: no budget fits" in out
    assert chosen["snapkv+2bit"]["budget"] > chosen["snapkv"]["budget"]  # more tokens in the same bytes
    for r in report["results"]:
        if r["method"] != "full":
            assert r["budget"] == chosen[r["method"]]["budget"]
            assert r["kv_bytes"] <= r["target_kv_bytes"]  # fewer steps than planned can only hold less
    assert {r["method"] for r in report["results"]} == {"full", "snapkv", "snapkv+2bit"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "snapkv,turbo"], "methods='turbo' is invalid"),
        (["--tasks", "passkey,essay"], "tasks='essay' is invalid"),
        (["--lengths", "10"], "lengths=10 is invalid"),
        (["--lengths", "1k"], "--lengths: '1k' is not valid"),
        (["--kv-ratio", "1.5"], "kv_ratio=1.5 is invalid"),
        (["--backend", "genai", "--methods", "chelsea"], "methods='chelsea' is invalid"),
        (["--backend", "genai", "--tasks", "passkey", "--kv-ratio", "0.2"], "kv_bytes="),
        (["--ppl-tokens", "2000", "--lengths", "1024"], "ppl_tokens=2000 is invalid"),
        (["--prompt-format", "raw"], "prompt_format='raw' is invalid"),
        (["--data", "samples/eval_data.jsonl", "--kv-ratio", "0.2"], "kv_ratio=(0.2,) is invalid"),
    ],
)
def test_cli_eval_refuses_bad_input_in_one_line(capsys, argv, message):
    code, _, err = run_main(capsys, "eval", *argv, "--no-progress")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_eval_names_the_bad_jsonl_line_before_loading_anything(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "answers": ["a"]}\n{"prompt": "ok", "answers": "a"}\n')
    code, _, err = run_main(capsys, "eval", "--data", str(data), "--no-progress")
    assert code == 2 and "bad.jsonl:2: 'answers' must be a non-empty list" in err


@pytest.mark.slow
def test_genai_backend_evaluates_native_methods(tmp_path, capsys):
    out_json = tmp_path / "g.json"
    code, _, err = run_main(
        capsys, "eval", "--backend", "genai", "--tasks", "passkey", "--lengths", "700", "--methods", "snapkv",
        "--budgets", "256", "--max-new-tokens", "16", "--json", str(out_json), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    res = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}
    assert set(res) == {"full", "snapkv"} and res["full"]["backend"] == "genai"
    assert res["full"]["score"] == 1.0 and res["snapkv"]["kv_bytes"] < res["full"]["kv_bytes"]


def test_method_spec_parsing():
    assert MethodSpec.parse("kvcrush+2bit") == MethodSpec("kvcrush", True)
    assert MethodSpec.parse("kvcrush+2bit").compression(128).method_config().quant is not None
    assert MethodSpec.parse("clusterkv").compression(128).options == {"track_recall": True}
    with pytest.raises(Exception, match="full\\+2bit"):
        MethodSpec.parse("full+2bit")
    quant = MethodSpec.parse("snapkv+k2v4").compression(128).method_config().quant
    assert (quant.kbits, quant.vbits, quant.label) == (2, 4, "k2v4")
    assert MethodSpec.parse("minikv+4bit").compression(128).method_config().quant.label == "4bit"
    for bad in ("minikv+2bit", "snapkv+8bit"):  # MiniKV is 2-bit already; 8 bits is the u8 store
        with pytest.raises(Exception, match="methods"):
            MethodSpec.parse(bad)
    spec = MethodSpec.parse("snapkv:block_size=32+4bit")
    assert spec.label == "snapkv:block_size=32+4bit"
    cfg = spec.compression(1024).method_config()
    assert cfg.block_size == 32 and cfg.quant.label == "4bit"
    windows = MethodSpec.parse("minikv:sink_tokens=0:recent_tokens=768").compression(1024)
    assert (windows.sink_tokens, windows.recent_tokens, windows.options) == (0, 768, {})
    with pytest.raises(ConfigError, match="block_size"):  # the method names its own bad option
        MethodSpec.parse("snapkv:block_size=0")
