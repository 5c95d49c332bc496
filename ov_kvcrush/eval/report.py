"""How an evaluation is shown: a table on stdout, a JSON file and a plot of score against KV bytes."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ov_kvcrush.errors import UserError, one_line
from ov_kvcrush.eval.runner import EvalReport, mean
from ov_kvcrush.validation import check_choice

# Imported where used, inside functions: what pulls in matplotlib, heavy to import, so that
# importing this module stays light.

# the plot's x axes: what each shows, as its label
X_AXES = {"mib": "KV MiB held (log)", "share": "KV held, share of the full cache (log)"}


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _order(r: dict[str, Any], methods: Sequence[str]) -> tuple:
    m = r["method"]
    return (
        r["task"],
        r["length"] or 0,
        methods.index(m) if m in methods else len(methods),
        m,
        r["budget"] or 0,
        r.get("target_kv_bytes") or 0,
    )


def _methods(results: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for r in results:
        if r["method"] not in seen:
            seen.append(r["method"])
    return seen


def format_table(report: EvalReport) -> str:
    """One row per (task, length, method, budget): score, agreement, KV bytes and their share of full."""
    results = report.results
    methods = _methods(results)
    head = ["task", "length", "method", "budget", "score", "agree", "KV MiB", "% full", "recall", "n"]
    rows = [head]
    for r in sorted(results, key=lambda r: _order(r, methods)):
        score_spec = ".2f" if r["metric"] == "perplexity" else ".3f"
        rows.append(
            [
                r["task"] + (" (ppl)" if r["metric"] == "perplexity" else ""),
                _fmt(r["length"], "d"),
                r["method"],
                _fmt(r["budget"], "d"),
                _fmt(r["score"], score_spec),
                _fmt(r["agreement"], ".3f"),
                _fmt(r["kv_bytes"] / 2**20, ".2f"),
                _fmt(100 * r["kv_bytes"] / r["full_kv_bytes"] if r["full_kv_bytes"] else None, ".1f"),
                _fmt(r.get("recall_rate"), ".3f"),
                str(r["n"]),
            ]
        )
    lines = [_line(rows[0], rows)] + ["-" * len(_line(rows[0], rows))] + [_line(row, rows) for row in rows[1:]]
    return "\n".join(lines) + "\n\n" + format_summary(report)


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, budget or memory target): means over every accuracy task and length, and the perplexity ratio.

    ``score_kept`` is the mean score over the full cache's on the same cells; ``ppl_ratio`` is
    the compressed perplexity over the full cache's for the same text (1.0 is
    lossless); ``kv_share`` the mean fraction of the full cache held.
    """
    full_score = {(r["task"], r["length"]): r["score"] for r in results if r["method"] == "full"}
    full_ppl = {
        (r["task"], r["length"]): r["score"] for r in results if r["method"] == "full" and r["metric"] == "perplexity"
    }
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["method"], r["budget"], r.get("target_kv_bytes")), []).append(r)
    out = []
    for (method, budget, target), rows in groups.items():
        acc = [r for r in rows if r["metric"] == "accuracy"]
        ppl = [r["score"] / full_ppl[(r["task"], r["length"])] for r in rows if r["metric"] == "perplexity"]
        reference = mean([full_score[(r["task"], r["length"])] for r in acc if (r["task"], r["length"]) in full_score])
        out.append(
            {
                "method": method,
                "budget": budget,
                "target_kv_bytes": target,
                "score": mean([r["score"] for r in acc]),
                "score_kept": mean([r["score"] for r in acc]) / reference if reference > 0 else float("nan"),
                "agreement": mean([r["agreement"] for r in rows]),  # ppl rows: argmax along the text
                "ppl_ratio": mean(ppl),
                "kv_share": mean([r["kv_bytes"] / r["full_kv_bytes"] for r in rows if r["full_kv_bytes"]]),
                "cells": len(acc),
            }
        )
    return out


def format_summary(report: EvalReport) -> str:
    rows_data = summary_rows(report.results)
    methods = _methods(report.results)
    rows_data.sort(key=lambda r: (methods.index(r["method"]), r["budget"] or 0, r["target_kv_bytes"] or 0))
    head = ["method", "budget", "mean score", "kept", "agree", "ppl / full", "% of full KV", "cells"]
    rows = [head]
    for r in rows_data:
        rows.append(
            [
                r["method"],
                _fmt(r["budget"], "d"),
                _fmt(r["score"], ".3f"),
                _fmt(r["score_kept"], ".2f"),
                _fmt(r["agreement"], ".3f"),
                _fmt(r["ppl_ratio"], ".3f"),
                _fmt(100 * r["kv_share"], ".1f"),
                str(r["cells"]),
            ]
        )
    title = (
        "summary over accuracy tasks and lengths (kept: score relative to the full cache's; "
        "ppl / full: perplexity relative to the full cache's)"
    )
    body = [_line(rows[0], rows), "-" * len(_line(rows[0], rows))] + [_line(row, rows) for row in rows[1:]]
    return title + "\n" + "\n".join(body)


def _line(row: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(row))]
    return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))


def write_json(report: EvalReport, path: str | Path, command: str | None = None) -> Path:
    """Write ``{"results": [...], "summary": [...], "budgets": [...], "meta": {...}, "samples": [...]}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = report.to_dict()
    payload["summary"] = summary_rows(report.results)
    if command:
        payload["meta"] = {**payload["meta"], "command": command}
    path.write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    return path


def plot(report: EvalReport, path: str | Path, title: str | None = None, x: str = "mib") -> Path:
    """Score against KV held, one line per method (its budgets as points), one panel per (length, task).

    ``x``: ``mib`` (KV MiB held) or ``share`` (its fraction of the same engine's full cache, the
    frontier's axis: lengths compare on one scale). The full cache is a star; perplexity panels
    have their own y axis (lower is better).
    """
    check_choice("x", x, tuple(X_AXES))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report.results
    tasks = list(dict.fromkeys(r["task"] for r in results))
    lengths = list(dict.fromkeys(r["length"] for r in results))
    methods = [m for m in _methods(results) if m != "full"]
    cmap = plt.get_cmap("tab10")
    colors = {m: cmap(i % 10) for i, m in enumerate(methods)}
    styles = {m: ("-", "--", ":")[(i // 10) % 3] for i, m in enumerate(methods)}
    markers = {m: "osD^vP<>Xh"[i % 10] for i, m in enumerate(methods)}  # overlapping lines stay readable
    # one row per length, one column per task; a single task lays its lengths out in a row
    one_task = len(tasks) == 1
    n_rows, n_cols = (1, len(lengths)) if one_task else (len(lengths), len(tasks))
    # the legend's width follows its longest label (method options and stores make long ones)
    legend_in = 0.7 + 0.065 * max((len(m) for m in [*methods, "full"]), default=4)
    width = 3.6 * n_cols + legend_in

    title_lines = textwrap.wrap(title, int(width * 14)) if title else []
    height = 2.9 * n_rows + 0.4 + 0.15 * len(title_lines)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width, height), squeeze=False)
    for i, length in enumerate(lengths):
        for j, task in enumerate(tasks):
            row, col = (0, i) if one_task else (i, j)
            ax = axes[row][col]
            cell = [r for r in results if r["task"] == task and r["length"] == length]
            if not cell:
                ax.set_visible(False)
                continue
            for m in methods:
                pts = sorted((_x(r, x), r["score"]) for r in cell if r["method"] == m)
                if pts:
                    style = dict(marker=markers[m], ms=4, mfc="none", lw=1.2, color=colors[m], ls=styles[m])
                    ax.plot(*zip(*pts, strict=True), label=m, **style)
            for r in cell:
                if r["method"] == "full":
                    ax.plot(_x(r, x), r["score"], marker="*", ms=11, color="black", ls="", label="full")
            ppl = cell[0]["metric"] == "perplexity"
            _dress_panel(ax, ppl, f"{task} @ {length} tok" if length else task)
            if row == n_rows - 1:
                ax.set_xlabel(X_AXES[x], fontsize=8)
            if col == 0 or ppl:
                ax.set_ylabel("perplexity (lower is better)" if ppl else "score", fontsize=8)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="center right", fontsize=8, frameon=False)
    if title_lines:
        fig.suptitle("\n".join(title_lines), fontsize=8)
    top = 1 - (0.15 * len(title_lines) + 0.1) / height if title_lines else 1
    fig.tight_layout(rect=(0, 0, 1 - legend_in / width, top))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _dress_panel(ax: Any, perplexity: bool, title: str) -> None:
    """A panel's axes: KV held on a log scale; perplexity on a log scale too, scores in [0, 1]."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    if perplexity:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    else:
        ax.set_ylim(-0.05, 1.05)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.tick_params(labelsize=7)


def _x(r: dict[str, Any], axis: str) -> float:
    if axis == "share":  # a row without the full cache's bytes has no share: not drawn
        return r["kv_bytes"] / r["full_kv_bytes"] if r["full_kv_bytes"] else float("nan")
    return r["kv_bytes"] / 2**20


# what identifies a measured configuration, and a prompt, across runs
_CONFIG_KEY = ("task", "length", "method", "budget", "target_kv_bytes", "backend")
_SAMPLE_KEY = (*_CONFIG_KEY, "index")
_SAME = ("score", "kv_bytes", "full_kv_bytes", "n")


def merge(reports: Sequence[tuple[str, EvalReport]]) -> EvalReport:
    """Runs over the same prompts as one report: a frontier built in parts (more budgets, more methods).

    Runs merge only when they asked the same questions: a prompt (task, length, sample index) that
    two runs share has the same answers and length, and a configuration both measured (the full
    cache, at least) has the same score and bytes in each. The engines are deterministic, so a
    difference means other prompts, another model or another build, and one plot would compare
    unlike things: that is an error naming both files, not a silent choice of one.
    """
    if not reports:
        raise UserError("no report to merge")
    results: dict[tuple, tuple[str, dict[str, Any]]] = {}
    samples: dict[tuple, dict[str, Any]] = {}
    prompts: dict[tuple, tuple[str, tuple]] = {}
    for name, report in reports:
        for r in report.results:
            key = tuple(r.get(k) for k in _CONFIG_KEY)
            if key in results:
                first, seen = results[key]
                if any(seen.get(k) != r.get(k) for k in _SAME):
                    raise UserError(
                        f"{first} and {name} disagree on {r['method']} (budget {r['budget']}) at {r['task']} "
                        f"{r['length']}: runs over other prompts, models or builds do not merge"
                    )
                continue
            results[key] = (name, r)
        for smp in report.samples:
            prompt = (smp["task"], smp["length"], smp["index"])
            asked = (tuple(smp.get("answers") or ()), smp.get("prompt_tokens"))
            first, seen = prompts.setdefault(prompt, (name, asked))
            if seen != asked:
                raise UserError(f"{first} and {name} asked other questions as {prompt[0]} {prompt[1]} #{prompt[2]}")
            samples.setdefault(tuple(smp.get(k) for k in _SAMPLE_KEY), smp)
    meta = {"merged_from": [{"file": name, "command": report.meta.get("command")} for name, report in reports]}
    budgets = [b for _, report in reports for b in report.budgets]
    return EvalReport([r for _, r in results.values()], list(samples.values()), budgets, meta)


def load(path: str | Path) -> EvalReport:
    """Read a report written by :func:`write_json` (to re-render tables and plots without re-running)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "results" not in data:
        raise UserError(f"{path} is not an eval report (no 'results'; one is written by ov-kvcrush eval --json)")
    return EvalReport(data["results"], data.get("samples", []), data.get("budgets", []), data.get("meta", {}))


def main(argv: list[str] | None = None) -> int:
    """``python -m ov_kvcrush.eval.report RESULTS.json [MORE.json ...] [--plot OUT.png] [--json OUT.json]``.

    Prints the tables again and re-plots; several runs over the same prompts are merged into one
    report (:func:`merge`), so a frontier measured in parts is shown, and kept, as one.
    """

    ap = argparse.ArgumentParser(prog="python -m ov_kvcrush.eval.report", description=main.__doc__)
    ap.add_argument("json_paths", nargs="+", metavar="RESULTS.json")
    ap.add_argument("--plot", help="write the plot here")
    ap.add_argument("--json", dest="json_out", help="write the (merged) report here")
    ap.add_argument("--x", default="mib", choices=tuple(X_AXES), help="the plot's x axis (default mib)")
    args = ap.parse_args(argv)
    try:
        loaded = [(p, load(p)) for p in args.json_paths]
        report = loaded[0][1] if len(loaded) == 1 else merge(loaded)
    except (OSError, ValueError) as exc:  # a missing, foreign or mismatched file is one line, not a trace
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    command = report.meta.get("command")
    if command is None or len(loaded) > 1:
        command = "python -m ov_kvcrush.eval.report " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(format_table(report))
    if args.json_out:
        print(f"json: {write_json(report, args.json_out, command)}")
    if args.plot:
        print(f"plot: {plot(report, args.plot, title=command, x=args.x)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
