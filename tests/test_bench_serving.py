"""``ov-kvcrush bench --concurrency``: the serving run's checks, its numbers on a tiny real run, and
the committed run against its command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import bench_script_dry_run, run_main

from ov_kvcrush.bench.serving import ServingPlan, checked_configs, format_serving, run_serving
from ov_kvcrush.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_serving_run_is_checked_before_anything_loads(capsys):
    with pytest.raises(ConfigError, match="backends"):
        checked_configs(ServingPlan(backends=("torch",), kv_pool_mib=10))
    with pytest.raises(ConfigError, match="kv_pool_mib"):
        checked_configs(ServingPlan(kv_pool_mib=0))
    with pytest.raises(ConfigError, match="concurrency"):
        checked_configs(ServingPlan(concurrency=0, kv_pool_mib=10))
    labels = [c.label for c in checked_configs(ServingPlan(methods=("full", "snapkv"), budgets=(512,), kv_pool_mib=64))]
    assert labels == ["genai full", "openvino full", "genai snapkv @512", "openvino snapkv @512"]
    code, _, err = run_main(capsys, "bench", "--concurrency", "4")
    assert code == 2 and "--kv-pool-mib is missing" in err
    code, _, err = run_main(capsys, "bench", "--concurrency", "4", "--kv-pool-mib", "64", "--lengths", "1024,2048")
    assert code == 2 and "one prompt length" in err


@pytest.mark.slow
def test_a_tiny_serving_run_on_the_real_pipelines():
    """Three requests over a pool that holds about two: every request is served by both backends,
    the throughput is the tokens generated over the wall time, and ours reports its waiting."""
    plan = ServingPlan(methods=("full",), concurrency=3, length=300, new_tokens=6, kv_pool_mib=12)
    doc = run_serving(plan)
    rows = {r["label"]: r for r in doc["results"]}
    assert set(rows) == {"genai full", "openvino full"}
    for r in rows.values():
        assert r["generated_tokens"] == 3 * 6
        assert r["throughput_tps"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        assert all(t is not None and t > 0 for t in r["ttft_ms"])
        assert r["ttft_p90_ms"] >= r["ttft_p50_ms"] > 0
        assert 0 < r["kv_pool_bytes"] <= 12 * 2**20
        assert r["peak_rss_bytes"] >= r["engine_rss_bytes"] > 50 * 2**20
    assert rows["openvino full"]["failed"] == 0
    assert rows["openvino full"]["waited_for_pool"] >= 1  # 12 MiB hold two of these sequences, not three
    assert rows["genai full"]["throughput_vs_native_full"] == 1.0
    assert "openvino full" in format_serving(doc)


@pytest.mark.slow
@pytest.mark.parametrize(
    "run, name",
    [
        ("serving", "serving_16x4k_cpu"),
        ("serving-decode", "serving_16x1k_decode_cpu"),
        ("serving-2bit", "serving_16x1k_decode_2bit_cpu"),
        ("serving-4bit", "serving_16x1k_decode_4bit_cpu"),
    ],
)
def test_the_committed_serving_runs_are_what_their_commands_run(run, name):
    proc = bench_script_dry_run("cpu.sh", run)
    assert proc.returncode == 0, proc.stderr
    planned = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    doc = json.loads((ROOT / "docs" / "results" / "serving" / f"{name}.json").read_text())
    assert [r["label"] for r in doc["results"]] == planned
    assert doc["command"].startswith("ov-kvcrush bench --concurrency 16")
    for r in doc["results"]:
        assert r["throughput_tps"] > 0 and r["requests"] == 16 and len(r["ttft_ms"]) == 16
