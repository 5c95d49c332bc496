"""Needles at 4k and 8k with our op's sparse prompt attention against its dense one (issue 72's
guard before sparse prefill may be a default: the sparse answers equal the dense full cache's).

For each length, ``--needles`` ``niah_single`` prompts (a 7-digit number after a key in essay
prose) are answered greedily by our op's full cache three ways: a dense prompt, our XAttention
(:class:`~ov_kvcrush.config.SparsePrefill`, its defaults unless set), and,
with ``--native``, openvino.genai's own XAttention on the same prompts. Writes a JSON of every
answer, whether it equals the dense one and is correct, each TTFT and our prompt density, and a
PNG of correct answers and TTFT per length::

    .venv/bin/python benchmarks/sparse_prefill_needles.py --lengths 4096,8000 --needles 6 --native \\
        --json docs/results/bench/sparse_prefill_needles.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from ov_kvcrush.config import GenerationSettings, SparsePrefill
from ov_kvcrush.engines.genai import GenAIEngine
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.models.export import ensure_default_model
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine


def plot(rows: list[dict], lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = [w for w in ("dense", "sparse", "native_sparse") if f"{w}_ttft_ms" in rows[0]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(ways)
    for k, w in enumerate(ways):
        xs = [i + k * width for i in range(len(lengths))]
        a.bar(xs, [sum(r[f"{w}_correct"] for r in rows if r["length"] == n) for n in lengths], width, label=w)
        b.bar(xs, [statistics.median(r[f"{w}_ttft_ms"] for r in rows if r["length"] == n) for n in lengths], width,
              label=w)  # fmt: skip
    for ax, title in ((a, "needles answered"), (b, "median TTFT (ms)")):
        ax.set_xticks([i + width * (len(ways) - 1) / 2 for i in range(len(lengths))], [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,8000")
    p.add_argument("--needles", type=int, default=6, help="prompts per length")
    p.add_argument("--threshold", type=float, default=SparsePrefill.threshold)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--dense-layers", type=int, default=SparsePrefill.dense_layers)
    p.add_argument("--native", action="store_true", help="also native's XAttention on the same prompts")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    model = ensure_default_model()
    dense = OpenVINOEngine(model)
    settings_used = SparsePrefill(
        block_size=a.block_size, stride=a.stride, threshold=a.threshold, dense_layers=a.dense_layers
    )
    sparse = OpenVINOEngine(model, sparse_prefill=settings_used)
    engines = {"dense": dense, "sparse": sparse}
    if a.native:
        engines["native_sparse"] = GenAIEngine(model, sparse_prefill="xattention")
    settings = GenerationSettings(max_new_tokens=24)
    rows = []
    for n in lengths:
        for i in range(a.needles):
            sample = T.GENERATION_TASKS["niah_single"](n, dense.count_tokens, 0, i, a.needles)
            row: dict = {"length": n, "needle": i, "answer": sample.answers[0]}
            for way, engine in engines.items():
                r = engine.generate(sample.prompt, settings)
                row |= {f"{way}": r.text, f"{way}_correct": bool(sample.score(r.text)), f"{way}_ttft_ms": r.ttft_ms}
                if "prefill_density" in r.counters:
                    row[f"{way}_density"] = r.counters["prefill_density"]
            for way in engines:
                row[f"{way}_equal_dense"] = row[way] == row["dense"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for n in lengths:
        at = [r for r in rows if r["length"] == n]
        summary[str(n)] = {
            **{f"{w}_correct": sum(r[f"{w}_correct"] for r in at) for w in engines},
            **{f"{w}_equal_dense": sum(r[f"{w}_equal_dense"] for r in at) for w in engines if w != "dense"},
            **{f"{w}_ttft_ms_median": round(statistics.median(r[f"{w}_ttft_ms"] for r in at), 1) for w in engines},
            "sparse_density_mean": round(statistics.mean(r["sparse_density"] for r in at), 4),
            "of": len(at),
        }
    print(json.dumps(summary))
    command = "benchmarks/sparse_prefill_needles.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(a).items() if v
    )
    out = {"command": command, "sparse": asdict(settings_used), "summary": summary, "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    plot(rows, lengths, Path(a.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
