"""``eval --backend openvino``: our op evaluated like the other engines, equal-memory budgets from
its own block bytes. Oracle for the bytes: the engine's report after a real generation."""

from __future__ import annotations

import json

import pytest
from helpers import run_main

from ov_kvcrush.config import CompressionConfig, GenerationSettings, MethodSpec
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.eval.runner import EvalPlan, run_eval
from ov_kvcrush.eval.tasks import passkey_prompt
from ov_kvcrush.methods import REGISTRY, methods_for
from ov_kvcrush.op.probe import OpProbe


@pytest.fixture(scope="module")
def engine(model_dir):
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(model_dir)


# every method the op runs (from the registry) at a budget that evicts, and the variants that
# change what a head holds: the 2-bit store, block-wise selection. The probe's pool computes no
# attention, so this is what says its bytes are a real run's.
PROBED = [CompressionConfig()] + [
    CompressionConfig(name, budget=128)
    for name in methods_for("openvino")
    if name != "full" and not REGISTRY[name].scoring_pass  # a scoring pass is not probed (the plan refuses it)
]
PROBED += [
    CompressionConfig("snapkv", budget=160, options={"quant": True}),
    CompressionConfig("kvcrush", budget=192, options={"block_size": 16}),
    CompressionConfig("minikv", budget=192, options={"quant": {"bits": 4}}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "compression",
    PROBED,
    ids=lambda c: c.method + ("+q" if c.options.get("quant") else "") + str(c.options.get("block_size", "")),
)
def test_the_probe_measures_what_the_engine_holds(engine, compression):
    engine.set_compression(compression)
    prompt = passkey_prompt(400, lambda t: len(engine.encode(t, apply_chat_template=False)), seed=1).prompt
    got = engine.generate(prompt, GenerationSettings(max_new_tokens=6, ignore_eos=True))
    probe = OpProbe.for_engine(engine)
    assert probe.held_bytes(compression, got.prompt_tokens, 6) == got.kv_bytes


@pytest.mark.slow
def test_eval_runs_on_the_op_at_equal_memory():
    plan = EvalPlan(
        tasks=("passkey",),
        lengths=(512,),
        methods=(MethodSpec("snapkv"), MethodSpec("snapkv", quant=True)),
        kv_ratio=(0.5,),  # room past the pinned prompt tail and a residual, for the 2-bit store to act
        backend="openvino",
        max_new_tokens=6,
    )
    report = run_eval(plan, progress=False, log=lambda line: None)
    chosen = {b["label"]: b for b in report.budgets}
    assert set(chosen) == {"snapkv", "snapkv+2bit"} and all(b["status"] == "ok" for b in chosen.values())
    assert chosen["snapkv+2bit"]["budget"] > chosen["snapkv"]["budget"]  # 2-bit: more tokens in the bytes
    rows = {r["method"]: r for r in report.results}
    assert set(rows) == {"full", "snapkv", "snapkv+2bit"} and all(r["backend"] == "openvino" for r in rows.values())
    for label in ("snapkv", "snapkv+2bit"):  # the engine holds what the solver aimed at, under the target
        assert rows[label]["kv_bytes"] == chosen[label]["kv_bytes"] <= rows[label]["target_kv_bytes"]


def test_the_plan_refuses_what_the_op_does_not_run():
    with pytest.raises(ConfigError, match="on backend openvino"):
        EvalPlan(tasks=("passkey",), methods=(MethodSpec("quest"),), backend="openvino")
    with pytest.raises(ConfigError, match="ppl"):
        EvalPlan(tasks=("ppl",), backend="openvino")


@pytest.mark.slow
def test_the_cli_evaluates_the_op(tmp_path, capsys):
    """Through the entry point's ``main`` (a fresh interpreter's start: test_user_errors, test_demo)."""
    out = tmp_path / "eval.json"
    code, _, err = run_main(
        capsys, "eval", "--backend", "openvino", "--tasks", "passkey", "--lengths", "300",
        "--methods", "snapkv,kvcrush", "--budgets", "128", "--max-new-tokens", "6", "--json", str(out),
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert {r["method"] for r in doc["results"]} == {"full", "snapkv", "kvcrush"}
    assert all(r["backend"] == "openvino" for r in doc["results"])
