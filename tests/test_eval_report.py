"""Report arithmetic on hand-made results: summary means, score kept, perplexity ratio, JSON round trip, plot."""

from __future__ import annotations

import json

import pytest

from ov_kvcrush.errors import UserError
from ov_kvcrush.eval.report import format_table, load, main, merge, plot, summary_rows, write_json
from ov_kvcrush.eval.runner import EvalReport, aggregate


def _rec(task, length, method, budget, score, kv, metric="accuracy", agreement=1.0):
    return {
        "task": task, "length": length, "method": method, "budget": budget, "backend": "torch", "metric": metric,
        "score": score, "agreement": agreement, "kv_bytes": kv, "full_kv_bytes": 1000, "prompt_tokens": length,
        "recall_rate": None, "target_kv_bytes": None,
    }  # fmt: skip


RECORDS = [
    _rec("passkey", 100, "full", None, 1.0, 1000),
    _rec("passkey", 100, "full", None, 0.0, 1000),
    _rec("passkey", 100, "snapkv", 64, 1.0, 200, agreement=0.5),
    _rec("passkey", 100, "snapkv", 64, 0.0, 300, agreement=0.25),
    _rec("niah_single", 100, "full", None, 1.0, 1000),
    _rec("niah_single", 100, "snapkv", 64, 0.0, 250),
    _rec("ppl", 100, "full", None, 10.0, 1000, metric="perplexity"),
    _rec("ppl", 100, "snapkv", 64, 12.5, 250, metric="perplexity", agreement=0.75),
]


def test_aggregate_means_per_combination():
    res = {(r["task"], r["method"]): r for r in aggregate(RECORDS)}
    assert len(res) == 6
    snap = res[("passkey", "snapkv")]
    assert (snap["score"], snap["agreement"], snap["kv_bytes"], snap["n"]) == (0.5, 0.375, 250, 2)
    assert res[("passkey", "full")]["score"] == 0.5


def test_summary_score_kept_and_perplexity_ratio():
    rows = {r["method"]: r for r in summary_rows(aggregate(RECORDS))}
    snap = rows["snapkv"]
    # accuracy cells: passkey 0.5 and niah 0.0 -> 0.25; full on the same cells: 0.5 and 1.0 -> 0.75
    assert snap["score"] == pytest.approx(0.25) and snap["score_kept"] == pytest.approx(1 / 3)
    assert snap["ppl_ratio"] == pytest.approx(1.25) and snap["cells"] == 2
    assert snap["kv_share"] == pytest.approx(0.25)
    assert rows["full"]["score_kept"] == pytest.approx(1.0) and rows["full"]["ppl_ratio"] == pytest.approx(1.0)


def test_json_round_trip_table_and_plot(tmp_path):
    report = EvalReport(aggregate(RECORDS), RECORDS, meta={"command": "ov-kvcrush eval --x"})
    path = write_json(report, tmp_path / "r.json", "ov-kvcrush eval --x")
    data = json.loads(path.read_text())
    assert set(data) >= {"results", "summary", "budgets", "meta", "samples"}
    again = load(path)
    assert again.results == report.results
    table = format_table(again)
    assert "snapkv" in table and "ppl (ppl)" in table and "12.50" in table
    png = plot(again, tmp_path / "r.png", title=again.meta["command"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _sample(method, budget, index, score, answers=("123",), tokens=100):
    return {
        "task": "niah_single", "length": 100, "method": method, "budget": budget, "backend": "openvino",
        "target_kv_bytes": None, "index": index, "score": score, "answers": list(answers), "prompt_tokens": tokens,
        "metric": "accuracy", "agreement": 1.0, "kv_bytes": 100 if budget else 1000, "full_kv_bytes": 1000,
        "recall_rate": None,
    }  # fmt: skip


def _run(budget, full_scores=(1.0, 0.0), scores=(1.0, 1.0), answers=("123",)):
    samples = [_sample("full", None, i, s, answers) for i, s in enumerate(full_scores)]
    samples += [_sample("snapkv", budget, i, s, answers) for i, s in enumerate(scores)]
    return EvalReport(aggregate(samples), samples, meta={"command": f"ov-kvcrush eval --budgets {budget}"})


def test_merge_joins_budgets_of_runs_over_the_same_prompts():
    merged = merge([("a.json", _run(64)), ("b.json", _run(32, scores=(0.0, 1.0)))])
    cells = {(r["method"], r["budget"]): r for r in merged.results}
    assert set(cells) == {("full", None), ("snapkv", 64), ("snapkv", 32)}  # the full cache once
    assert cells[("snapkv", 64)]["score"] == 1.0 and cells[("snapkv", 32)]["score"] == 0.5
    assert len(merged.samples) == 6  # 2 full + 2 per budget: the repeated full samples are not doubled
    assert [m["file"] for m in merged.meta["merged_from"]] == ["a.json", "b.json"]


def test_merge_refuses_runs_that_asked_other_questions_or_disagree():
    with pytest.raises(UserError, match=r"a\.json and b\.json asked other questions"):
        merge([("a.json", _run(64)), ("b.json", _run(32, answers=("999",)))])
    with pytest.raises(UserError, match=r"a\.json and b\.json disagree on full"):
        merge([("a.json", _run(64)), ("b.json", _run(32, full_scores=(1.0, 1.0)))])


def test_report_command_merges_and_plots_share_of_full(tmp_path, capsys):
    a, b = write_json(_run(64), tmp_path / "a.json"), write_json(_run(32), tmp_path / "b.json")
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    assert main([str(a), str(b), "--x", "share", "--json", str(out_json), "--plot", str(out_png)]) == 0
    merged = load(out_json)
    assert {r["budget"] for r in merged.results} == {None, 64, 32}
    assert merged.meta["command"].startswith("python -m ov_kvcrush.eval.report ")
    assert out_png.stat().st_size > 0
    (tmp_path / "foreign.json").write_text('{"rows": []}')
    assert main([str(a), str(tmp_path / "foreign.json")]) == 2
    assert "is not an eval report" in capsys.readouterr().err
    with pytest.raises(UserError, match="x='bytes' is invalid"):
        plot(merged, tmp_path / "x.png", x="bytes")
