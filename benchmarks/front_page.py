"""The README's picture, drawn from committed results only: what a method keeps of the full
cache's answers against the KV bytes it holds, and what it costs or saves in time.

    python benchmarks/front_page.py      # writes docs/results/front_page.png

Left: needles answered relative to our full cache (72 needle questions: 24 at each of 2k, 4k and
6k tokens) against the KV bytes held as a share of our full cache, one line per method over
budgets 256, 512 and 1024 (``docs/results/quality/frontier_niah_sweep_op_cpu.json``). Right: at
8k tokens and budget 1024, TTFT and TPOT against native openvino_genai's full cache, and the KV
bytes held against it (``docs/results/bench/quant_decode_kernel_op_cpu.json``). Our op, the
embedded SmolLM2-135M, the CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUALITY = ROOT / "docs/results/quality/frontier_niah_sweep_op_cpu.json"
SPEED = ROOT / "docs/results/bench/quant_decode_kernel_op_cpu.json"
OUT = ROOT / "docs/results/front_page.png"
#: what each configuration is called on the picture
NAMES = {
    "snapkv": "SnapKV, tokens",
    "kvcrush": "KVCrush, tokens",
    "snapkv:block_size=32": "SnapKV, 32-token spans",
    "snapkv:block_size=32+4bit": "SnapKV spans, 4-bit store",
    "kvcrush:block_size=32:scope=head+4bit": "KVCrush spans per KV head, 4-bit",
    "snapkv:block_size=32+2bit": "SnapKV spans, 2-bit store",
    "minikv": "MiniKV (default)",
}


def quality_lines(doc: dict) -> dict[str, list[tuple[float, float, int]]]:
    """Per configuration: (KV share, answers kept, budget), by budget."""
    lines: dict[str, list[tuple[float, float, int]]] = {}
    for row in doc["summary"]:
        if row["method"] in NAMES and row["budget"] is not None:
            lines.setdefault(row["method"], []).append((row["kv_share"], row["score_kept"], row["budget"]))
    return {name: sorted(points) for name, points in lines.items()}


def speed_rows(doc: dict, length: int = 8000) -> list[dict]:
    """Our op's rows at ``length`` tokens, with their ratios to native full."""
    return [r for r in doc["results"] if r["length"] == length and r["backend"] == "openvino"]


def draw(quality: dict, speed: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.25, 1]})
    for method, points in quality_lines(quality).items():
        xs, ys, _ = zip(*points, strict=True)
        a.plot([100 * x for x in xs], ys, marker="o", label=NAMES[method])
        for x, y, budget in points:
            a.annotate(str(budget), (100 * x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    a.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    a.text(1, 1.01, "full cache", color="grey", fontsize=8)
    a.set(
        xlabel="KV bytes held, % of our full cache (u8)",
        ylabel="needles answered / full cache's",
        title="72 needle questions at 2k, 4k and 6k tokens (budgets marked)",
    )
    a.grid(alpha=0.3)
    a.legend(fontsize=8, loc="lower right")
    rows = speed_rows(speed)
    labels = [r["label"].replace("openvino ", "ours ").replace(" @1024", "") for r in rows]
    ys = range(len(rows))
    b.barh([y + 0.2 for y in ys], [r["tpot_vs_anchor"] for r in rows], height=0.4, label="TPOT")
    b.barh([y - 0.2 for y in ys], [r["ttft_vs_anchor"] for r in rows], height=0.4, label="TTFT")
    for y, r in zip(ys, rows, strict=True):
        b.text(0.02, y + 0.02, f"KV {100 * r['kv_vs_anchor']:.0f} % of native full", fontsize=8, color="white")
    b.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    b.set_yticks(list(ys), labels, fontsize=8)
    b.set(xlabel="time / native openvino_genai full cache", title="8k tokens, budget 1024 (1.0 = native full)")
    b.grid(alpha=0.3, axis="x")
    b.legend(fontsize=8, loc="lower right")
    fig.suptitle("ov_kvcrush on the embedded SmolLM2-135M, our op on a 2-core CPU (committed results)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality", type=Path, default=QUALITY)
    ap.add_argument("--speed", type=Path, default=SPEED)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    draw(json.loads(args.quality.read_text()), json.loads(args.speed.read_text()), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
