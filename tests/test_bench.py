"""The benchmark harness (``ov-kvcrush bench``): its plan, order, arithmetic and JSON, fast.

The measuring itself is exercised with fake engines (known timings and bytes, so every reported
number has an exact expected value) and once, briefly, with the real engines on the embedded model.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from bench_fakes import HELD, FakeEngine, crashing_engine, holding_engine, refusing_engine
from helpers import bench_script_dry_run

from ov_kvcrush import bench
from ov_kvcrush.bench import BenchConfig, BenchPlan
from ov_kvcrush.bench.plan import compression
from ov_kvcrush.engines.base import GenerationResult
from ov_kvcrush.errors import ConfigError, UserError


def test_schedule_interleaves_and_alternates_direction():
    a, b, c = (BenchConfig("genai", "full"), BenchConfig("openvino", "full"), BenchConfig("torch", "full"))
    order = bench.schedule([a, b, c], [100, 200], repeats=3)
    assert order[:6] == [(0, 100, a), (0, 100, b), (0, 100, c), (0, 200, a), (0, 200, b), (0, 200, c)]
    assert order[6:12] == [(1, 100, c), (1, 100, b), (1, 100, a), (1, 200, c), (1, 200, b), (1, 200, a)]
    assert [(n, x) for _, n, x in order[12:]] == [(n, x) for _, n, x in order[:6]]
    assert all(r == 2 for r, _, _ in order[12:])
    assert len(order) == 3 * 2 * 3
    with pytest.raises(ConfigError, match="repeats"):
        bench.schedule([a], [100], repeats=0)


def test_plan_refuses_unknown_backends_and_methods_by_name():
    """Before any model loads: a bad backend, method or budget is named with what is allowed."""
    with pytest.raises(ConfigError, match=r"backend=.?nope.? is invalid: allowed one of genai, openvino, torch"):
        bench.plan_configs(["nope"], ["full"], [256])
    with pytest.raises(ConfigError, match=r"method=.?bogus"):
        bench.plan_configs(["genai", "openvino"], ["bogus"], [256])
    with pytest.raises(ConfigError, match="budget"):
        bench.check_config(BenchConfig("openvino", "snapkv", 0))
    with pytest.raises(ConfigError, match="budget"):
        bench.check_config(BenchConfig("genai", "full", 128))
    # a budget the native backend refuses for a method it has is an error, not a silent skip
    with pytest.raises(ConfigError, match="budget=128"):
        bench.plan_configs(["genai", "openvino"], ["snapkv"], [128])


def test_plan_runs_each_method_where_it_can_and_anchors_on_native_full():
    cfgs = bench.plan_configs(["genai", "openvino"], ["full", "kvcrush", "chelsea"], [256, 512])
    labels = [c.label for c in cfgs]
    assert labels[0] == "genai full"  # the anchor every ratio divides by
    assert labels.count("genai full") == 1 and "openvino full" in labels
    assert {"genai kvcrush @256", "genai kvcrush @512", "openvino kvcrush @256", "openvino kvcrush @512"} <= set(labels)
    # Chelsea is not a native openvino_genai method: only ours runs it
    assert "openvino chelsea @256" in labels and not any(x.startswith("genai chelsea") for x in labels)


def test_sparse_prefill_runs_beside_each_configuration_that_has_it_and_is_named_in_its_label():
    """``--sparse-prefill`` (issue 72, items 3 and 5): each configuration gets a twin per mode its
    backend runs (native's two, our op's XAttention); a bad mode, or modes no configuration's
    backend runs, is refused by name."""
    plan = BenchPlan(backends=("genai", "openvino"), methods=("full", "snapkv"), lengths=(300,),
                     sparse_prefill=("xattention", "trishape"))  # fmt: skip
    cfgs, _ = bench.checked_plan(plan)
    assert [c.label for c in cfgs] == [
        "genai full", "genai full sparse_prefill=xattention", "genai full sparse_prefill=trishape",
        "openvino full", "openvino full sparse_prefill=xattention",
        "genai snapkv @1024", "genai snapkv sparse_prefill=xattention @1024",
        "genai snapkv sparse_prefill=trishape @1024",
        "openvino snapkv @1024", "openvino snapkv sparse_prefill=xattention @1024",
    ]  # fmt: skip
    assert cfgs[1].engine_options == {"sparse_prefill": "xattention"} and cfgs[0].engine_options == {}
    with pytest.raises(ConfigError, match=r"sparse_prefill='dense' is invalid: allowed one of xattention, trishape"):
        bench.checked_plan(BenchPlan(lengths=(300,), sparse_prefill=("dense",)))
    with pytest.raises(ConfigError, match=r"sparse_prefill='trishape' is invalid: allowed none without backend genai"):
        bench.with_sparse_prefill([BenchConfig("openvino", "full")], ("trishape",))
    with pytest.raises(ConfigError, match=r"sparse_prefill=.*none without backend genai or openvino"):
        bench.with_sparse_prefill([BenchConfig("torch", "full")], ("xattention",))


def test_percentile_and_floor_arithmetic():
    assert bench.measure.percentile([5.0], 90) == 5.0
    assert bench.measure.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 50) == pytest.approx(5.5)
    assert bench.measure.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1)
    assert bench.measure.percentile([10, 0], 100) == 10
    # 100 MB of weights + 20 MB of KV at 12 GB/s: 10 ms
    assert bench.measure.floor_ms(100_000_000, 20_000_000, 12.0) == pytest.approx(10.0)
    with pytest.raises(ConfigError, match="bandwidth"):
        bench.measure.floor_ms(1, 1, 0.0)


def _run(label, backend, method, budget, length, rep, ttft, tpot, kv, rss=1000, correct=True):
    return {
        "label": label,
        "backend": backend,
        "method": method,
        "budget": budget,
        "options": {},
        "length": length,
        "repeat": rep,
        "prompt_tokens": length - 3,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "tpot_p90_ms": tpot * 1.5,
        "kv_bytes": kv,
        "peak_rss_bytes": rss,
        "correct": correct,
        "policy_decode_share": None if backend == "genai" else 0.01,
        "policy_prefill_share": None,
    }


def test_summarize_takes_medians_and_divides_by_native_full_at_the_same_length():
    runs = [
        _run("genai full", "genai", "full", None, 1000, 0, 100.0, 20.0, 8_000_000, rss=5),
        _run("genai full", "genai", "full", None, 1000, 1, 120.0, 24.0, 8_000_000, rss=7),
        _run("genai full", "genai", "full", None, 1000, 2, 110.0, 40.0, 8_000_000, rss=6),
        _run("genai full", "genai", "full", None, 2000, 0, 300.0, 30.0, 16_000_000),
        _run("openvino snapkv @256", "openvino", "snapkv", 256, 1000, 0, 90.0, 10.0, 2_000_000),
        _run("openvino snapkv @256", "openvino", "snapkv", 256, 1000, 1, 95.0, 12.0, 2_000_000, correct=False),
        _run("openvino snapkv @256", "openvino", "snapkv", 256, 2000, 0, 150.0, 15.0, 2_000_000),
    ]
    res = bench.summarize(runs, {"genai": 40_000_000, "openvino": 40_000_000}, bandwidth_gbps=10.0)
    by = {(r["label"], r["length"]): r for r in res}
    full = by[("genai full", 1000)]
    assert full["tpot_ms"] == 24.0 and full["ttft_ms"] == 110.0 and full["runs"] == 3
    assert full["peak_rss_bytes"] == 7 and full["decode_tokens_per_s"] == pytest.approx(1000 / 24)
    assert full["tpot_vs_native_full"] == 1.0 and full["kv_vs_native_full"] == 1.0
    # floor: (40 MB + 8 MB) / 10 GB/s = 4.8 ms
    assert full["floor_ms"] == pytest.approx(4.8) and full["tpot_vs_floor"] == pytest.approx(24 / 4.8)
    snap = by[("openvino snapkv @256", 1000)]
    assert snap["tpot_ms"] == 11.0 and snap["correct"] == 1
    assert snap["tpot_vs_native_full"] == pytest.approx(11 / 24) and snap["kv_vs_native_full"] == 0.25
    assert snap["policy_decode_share"] == 0.01 and full["policy_decode_share"] is None
    snap2 = by[("openvino snapkv @256", 2000)]
    assert snap2["tpot_vs_native_full"] == pytest.approx(15 / 30) and snap2["kv_vs_native_full"] == 0.125


def test_validate_doc_names_what_is_wrong():
    good = {"results": [], "runs": [], "bandwidth_gbps": 10.0, "machine": {}}
    bench.validate_doc(good)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        bench.validate_doc({**good, "bandwidth_gbps": None})
    row = {k: 0 for k in bench.RESULT_KEYS} | {"backend": "genai", "method": "full", "budget": None}
    bench.validate_doc({**good, "results": [row]})
    with pytest.raises(ValueError, match=r"results\[0\] lacks peak_rss_bytes"):
        bench.validate_doc({**good, "results": [{k: v for k, v in row.items() if k != "peak_rss_bytes"}]})
    with pytest.raises(ValueError, match="kv_bytes"):
        bench.validate_doc({**good, "results": [row | {"kv_bytes": -1}]})


def test_run_bench_measures_every_configuration_in_the_scheduled_order(monkeypatch):
    monkeypatch.setattr(bench.measure, "measure_bandwidth_gbps", lambda: 20.0)
    monkeypatch.setattr(bench.measure, "weight_bytes", lambda engine: 50_000_000)
    log: list = []
    speed = {"genai": 4.0, "openvino": 2.0}
    plan = BenchPlan(backends=("genai", "openvino"), methods=("full", "snapkv"), budgets=(256,), lengths=(300, 600))
    plan.repeats, plan.new_tokens, plan.isolate = 2, 6, False
    doc = bench.run_bench(plan, engine_factory=lambda c: FakeEngine(c, speed[c.backend], 100, log))
    bench.validate_doc(json.loads(json.dumps(doc)))  # plain JSON, the schema holds
    configs = bench.plan_configs(plan.backends, plan.methods, plan.budgets)
    assert [lab for lab, _ in log] == [c.label for _, _, c in bench.schedule(configs, plan.lengths, plan.repeats)]
    assert len(doc["runs"]) == len(log) == 2 * 2 * len(configs)
    assert doc["bandwidth_gbps"] == 20.0 and doc["machine"]["cores"] >= 1 and "openvino" in doc["versions"]
    res = {(r["label"], r["length"]): r for r in doc["results"]}
    for (label, length), r in res.items():
        step = speed[r["backend"]]
        assert r["tpot_ms"] == step  # the median step, not the mean the slow step pulls up
        assert r["tpot_p90_ms"] > r["tpot_ms"]
        assert r["correct"] == 2 and r["runs"] == 2
        assert r["peak_rss_bytes"] > 0
        assert r["tpot_vs_native_full"] == pytest.approx(step / speed["genai"])
        held = r["prompt_tokens"] if r["budget"] is None else min(r["prompt_tokens"], 256)
        assert r["kv_bytes"] == held * 100
        assert r["floor_ms"] == pytest.approx((50_000_000 + held * 100) / 20e9 * 1e3)
        assert length in (300, 600) and label
    # 1 ms of method work over 5 decode steps whose mean is (4 * 2 + 10) / 5 ms
    assert res[("openvino snapkv @256", 600)]["policy_decode_share"] == pytest.approx(1.0 / 18.0)
    assert res[("genai snapkv @256", 600)]["policy_decode_share"] is None
    # the report and the plot are made from the document
    assert "openvino snapkv @256" in bench.format_table(doc)
    md = bench.format_markdown(doc).splitlines()
    assert len(md) == 2 + len(doc["results"]) and all(line.count("|") == md[0].count("|") for line in md)
    snap = res[("openvino snapkv @256", 600)]
    ttft_x = snap["ttft_ms"] / res[("genai full", 600)]["ttft_ms"]
    assert snap["ttft_vs_anchor"] == pytest.approx(ttft_x) and doc["anchor"] == "genai full"
    head = f"| openvino snapkv @256 | {snap['prompt_tokens']} | {snap['ttft_ms']:.0f} | {ttft_x:.2f}×"
    line = f"{head} | 2.0 | 6.8 | 500.0 |"
    assert any(x.startswith(line) and x.endswith("| 2/2 |") for x in md)


class FakeBatchEngine(FakeEngine):
    """A batch is its prompts' results, each row a share of the batch's KV; the step reads a
    tenth of what the batch holds (a method that recalls a subset)."""

    def generate_batch(self, prompts: list[str], settings) -> list[GenerationResult]:
        rows = [self.generate(p, settings) for p in prompts]
        read = sum(r.kv_bytes for r in rows) // 10
        for r in rows:
            r.counters = {"kv_read_bytes": read, "batch_rows": len(rows)}
        return rows


def test_a_batched_run_decodes_every_row_and_reads_what_the_method_reads(monkeypatch):
    """``--concurrency 3`` on the torch backends: every run is one batch of three different
    prompts of one token count; tok/s counts the rows, KV bytes sum them, and the floor is the
    weights once plus the KV bytes the step reads."""
    monkeypatch.setattr(bench.measure, "measure_bandwidth_gbps", lambda device="cpu": 20.0)
    monkeypatch.setattr(bench.measure, "weight_bytes", lambda engine: 50_000_000)
    log: list = []
    plan = BenchPlan(backends=("torch", "hf-sdpa"), methods=("full", "clusterkv"), budgets=(256,), lengths=(300,))
    plan.repeats, plan.new_tokens, plan.isolate, plan.model, plan.batch = 1, 6, False, "random:tiny-llama", 3
    doc = bench.run_bench(plan, engine_factory=lambda c: FakeBatchEngine(c, 2.0, 100, log))
    assert doc["anchor"] == "hf-sdpa full" and doc["plan"]["batch"] == 3
    assert len(log) == 3 * 3  # three configurations, each one batch of three rows
    batches = [log[i : i + 3] for i in range(0, len(log), 3)]
    assert all(len({label for label, _ in b}) == 1 and len({n for _, n in b}) == 1 for b in batches)
    for r in doc["results"]:
        assert r["batch"] == 3 and r["decode_tokens_per_s"] == pytest.approx(3 * 1000 / r["tpot_ms"])
        held = r["prompt_tokens"] if r["budget"] is None else min(r["prompt_tokens"], 256)
        assert r["kv_bytes"] == 3 * held * 100 and r["kv_read_bytes"] == 3 * held * 100 // 10
        assert r["floor_ms"] == pytest.approx((50_000_000 + r["kv_read_bytes"]) / 20e9 * 1e3)
        assert r["correct"] is None  # random weights: speed only
    assert "x3" in bench.format_table(doc) and "×3" in bench.format_markdown(doc)
    with pytest.raises(ConfigError, match="concurrency"):
        bench.dry_run(BenchPlan(backends=("genai", "openvino"), lengths=(300,), batch=2))


def test_run_bench_uses_a_fresh_prompt_every_repeat(monkeypatch):
    monkeypatch.setattr(bench.measure, "measure_bandwidth_gbps", lambda: 20.0)
    monkeypatch.setattr(bench.measure, "weight_bytes", lambda engine: 1)
    prompts: list[str] = []

    class Recorder(FakeEngine):
        def generate(self, prompt, settings):
            prompts.append(prompt)
            return super().generate(prompt, settings)

    plan = BenchPlan(backends=("genai",), methods=("full",), budgets=(128,), lengths=(400,), repeats=3, new_tokens=3)
    plan.isolate = False
    bench.run_bench(plan, engine_factory=lambda c: Recorder(c, 1.0, 1, []))
    assert len(prompts) == 3 and len(set(prompts)) == 3


def test_bench_plot_writes_a_png(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.measure, "measure_bandwidth_gbps", lambda: 20.0)
    monkeypatch.setattr(bench.measure, "weight_bytes", lambda engine: 1)
    plan = BenchPlan(backends=("genai", "openvino"), methods=("full",), budgets=(128,), lengths=(300, 400))
    plan.repeats, plan.new_tokens, plan.isolate = 1, 3, False
    doc = bench.run_bench(plan, engine_factory=lambda c: FakeEngine(c, 1.0, 1, []))
    out = tmp_path / "bench.png"
    bench.plot(doc, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_method_items_carry_options_checked_by_the_method():
    cfgs = bench.plan_configs(["openvino"], ["kvcrush:block_size=32", "snapkv:quant=true", "snapkv"], [256])
    by = {c.label: c for c in cfgs}
    assert by["openvino kvcrush block_size=32 @256"].options == {"block_size": 32}
    assert by["openvino snapkv quant=True @256"].options == {"quant": True}
    assert "openvino snapkv @256" in by  # the same method without options is another configuration
    # options a backend does not take leave it out for that backend (native KVCrush has no block_size)
    labels = [c.label for c in bench.plan_configs(["genai", "openvino"], ["kvcrush:block_size=32"], [256])]
    assert labels == ["genai full", "openvino kvcrush block_size=32 @256"]
    with pytest.raises(UserError, match="bogus"):
        bench.plan_configs(["openvino"], ["kvcrush:bogus=1"], [256])
    with pytest.raises(UserError, match=r"--methods kvcrush: 'block_size' is invalid: expected KEY=VALUE"):
        bench.plan_configs(["openvino"], ["kvcrush:block_size"], [256])
    with pytest.raises(ConfigError, match="options"):
        bench.plan_configs(["openvino"], ["full:block_size=32"], [256])
    # a store after +, as eval names it
    (cfg,) = bench.plan_configs(["openvino"], ["kvzip:allocation=layer+k2v4"], [256], anchor=None)
    assert cfg.options == {"allocation": "layer", "quant": {"key_bits": 2, "value_bits": 4}}
    assert cfg.label == "openvino kvzip allocation=layer+k2v4 @256"  # named as --methods names it
    assert compression(cfg).method_config().quant.label == "k2v4"
    with pytest.raises(ConfigError, match=r"\+4bit"):
        bench.plan_configs(["openvino"], ["snapkv+3bit"], [256])
    with pytest.raises(ConfigError, match="not both"):
        bench.plan_configs(["openvino"], ["snapkv:quant=true+4bit"], [256])


@pytest.mark.slow
def test_isolated_configurations_report_their_own_memory(monkeypatch):
    """In worker processes, one configuration's 96 MiB shows in its own peak RSS and not in the
    other's; in one process, the other configuration's peak includes them (why isolation is on)."""
    monkeypatch.setattr(bench.measure, "measure_bandwidth_gbps", lambda: 20.0)
    plan = BenchPlan(backends=("genai", "openvino"), methods=("snapkv",), budgets=(256,), lengths=(300,))
    plan.repeats, plan.new_tokens = 2, 3
    doc = bench.run_bench(plan, engine_factory=holding_engine)
    res = {r["label"]: r for r in doc["results"]}
    grew = {label: r["peak_rss_bytes"] - r["engine_rss_bytes"] for label, r in res.items()}
    assert grew["openvino snapkv @256"] >= HELD["openvino snapkv @256"]
    assert grew["genai full"] < 32 << 20 and grew["genai snapkv @256"] < 32 << 20
    assert doc["isolation"].startswith("one worker process per configuration")
    assert [r["correct"] for r in res.values()] == [2, 2, 2]

    plan.isolate = False
    doc = bench.run_bench(plan, engine_factory=holding_engine)
    res = {r["label"]: r for r in doc["results"]}
    # backward on repeat 1: the 96 MiB are held when native full runs
    assert res["genai full"]["peak_rss_bytes"] - res["genai full"]["engine_rss_bytes"] >= 96 << 20


@pytest.mark.slow
def test_a_dying_or_failing_worker_is_a_clear_error_naming_the_configuration(monkeypatch):
    monkeypatch.setattr(bench.measure, "measure_bandwidth_gbps", lambda: 20.0)
    plan = BenchPlan(backends=("openvino",), methods=("snapkv",), budgets=(256,), lengths=(300,))
    plan.repeats, plan.new_tokens = 1, 3
    with pytest.raises(bench.WorkerError, match=r"'openvino snapkv @256' died \(exit code 7\)"):
        bench.run_bench(plan, engine_factory=crashing_engine)
    with pytest.raises(bench.WorkerError, match=r"openvino snapkv @256: ConfigError: kv_precision='f8' is invalid"):
        bench.run_bench(plan, engine_factory=refusing_engine)
    assert not multiprocessing.active_children()  # every worker was stopped


@pytest.mark.slow
def test_bench_on_the_real_engines_briefly(tmp_path):
    """Native full cache and SnapKV in our op and in the torch engine on the embedded model, one
    short run each, each configuration in its own worker: the harness drives the real engines and
    the numbers it reports are consistent."""
    plan = BenchPlan(backends=("genai", "openvino", "torch"), methods=("full", "snapkv"), budgets=(256,))
    plan.lengths, plan.repeats, plan.new_tokens = (400,), 1, 4
    doc = bench.run_bench(plan)
    bench.validate_doc(doc)
    res = {r["label"]: r for r in doc["results"]}
    assert set(res) == {f"{b} {m}" for b in plan.backends for m in ("full", "snapkv @256")}
    assert doc["bandwidth_gbps"] > 0.1 and doc["weight_bytes"]["genai"] > 10_000_000
    for r in res.values():
        assert 0 < r["prompt_tokens"] <= 400 and r["ttft_ms"] > 0 and r["tpot_ms"] > 0
        assert r["tpot_vs_floor"] > 1.0  # nothing beats reading the weights once
        assert 100 * 2**20 < r["engine_rss_bytes"] <= r["peak_rss_bytes"]
    # the compressing methods hold their budget per layer and KV head; the full cache all tokens
    for b in ("openvino", "torch"):
        assert res[f"{b} snapkv @256"]["kv_bytes"] < res[f"{b} full"]["kv_bytes"]
        # the method's own share of prefill, measured inside our op and the torch cache
        assert 0.0 < res[f"{b} snapkv @256"]["policy_prefill_share"] < 1.0
    assert res["genai snapkv @256"]["kv_vs_native_full"] < 1.0
    assert res["genai snapkv @256"]["policy_prefill_share"] is None  # native: not measurable


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "run, name",
    [
        ("main", "bench_cpu"),
        ("gemma", "bench_cpu_gemma3"),
        ("gemma-blocks", "bench_cpu_gemma3_blocks"),
        ("full", "bench_cpu_full_cache"),
        ("torch", "bench_cpu_torch"),
    ],
)
def test_committed_results_are_what_their_benchmark_command_runs(run, name):
    """`benchmarks/cpu.sh` still plans (checked as a real run would be, nothing loaded), and the
    committed JSON holds its configurations and lengths and passes the schema."""
    proc = bench_script_dry_run("cpu.sh", run)
    assert proc.returncode == 0, proc.stderr
    planned = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    lengths = [int(x) for x in proc.stdout.split("lengths: ")[1].split(",")]
    doc = json.loads((ROOT / "docs" / "results" / "bench" / f"{name}.json").read_text())
    bench.validate_doc(doc)
    assert list(dict.fromkeys(r["label"] for r in doc["results"])) == planned
    assert sorted({r["length"] for r in doc["results"]}) == lengths
    assert doc["command"].startswith("ov-kvcrush bench ")


def test_gpu_configurations_are_warmed_up_before_the_timed_runs():
    """A configuration on a GPU generates once, untimed, before its repeats (its kernels compile at
    the first call); a CPU configuration does not."""
    from ov_kvcrush.bench.run import WARM_UP_NEW, warm_up

    calls: list = []

    class Runner:
        def count(self, text):
            return len(text.split())

        def generate(self, prompt, settings):
            calls.append((self, settings.max_new_tokens))
            return None, 0

    plan = BenchPlan(backends=("torch", "genai"), methods=("full",), budgets=(128,), lengths=(400,), device="cuda")
    configs = bench.plan_configs(plan.backends, plan.methods, plan.budgets)
    runners = {c.label: Runner() for c in configs}
    said: list[str] = []
    warm_up(plan, configs, runners, said.append)
    assert calls == [(runners["torch full"], WARM_UP_NEW)]
    assert said == ["warming up torch full"]
    plan.device = "cpu"
    warm_up(plan, configs, runners, said.append)
    assert len(calls) == 1
