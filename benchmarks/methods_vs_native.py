"""The methods inside our op against native openvino_genai (full cache and its KVCrush), one run.

Every configuration runs the same int8 IR of the embedded model on the CPU with the plugin's
default properties, on the same fresh passkey prompt per repeat (native prefix caching is off in
our genai engine, and each repeat uses a new prompt anyway); configurations alternate order
between repeats so machine noise hits all alike. Reported per configuration: median TTFT and
TPOT, KV bytes held at the end, the share of decode and prefill time the method's own work took
(selection/eviction/2-bit flush, measured inside the op), whether the passkey was answered, and
the ratios to native full cache.

    python benchmarks/methods_vs_native.py --length 8000 --budget 1024 --repeats 2 \\
        --json docs/results/methods_vs_native.json --plot docs/results/methods_vs_native.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from run_info import write_results

#: (label, backend, method, options, engine kwargs)
CONFIGS = [
    ("native full", "genai", "full", {}, {}),
    ("native kvcrush", "genai", "kvcrush", {}, {}),
    ("ours full (f16)", "openvino", "full", {}, {}),
    ("ours h2o", "openvino", "h2o", {}, {}),
    ("ours snapkv", "openvino", "snapkv", {}, {}),
    ("ours pyramidkv", "openvino", "pyramidkv", {}, {}),
    ("ours kvcrush", "openvino", "kvcrush", {}, {}),
    ("ours kvcrush blocks", "openvino", "kvcrush", {"block_size": 32}, {}),
    ("ours clusterkv", "openvino", "clusterkv", {}, {}),
    ("ours chelsea", "openvino", "chelsea", {}, {}),
    ("ours minikv (2-bit)", "openvino", "minikv", {}, {}),
    ("ours snapkv + 2-bit", "openvino", "snapkv", {"quant": True}, {}),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8000, help="prompt tokens (the model's context is 8192)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed per run (EOS ignored)")
    ap.add_argument("--only", default="", help="comma-separated labels to run (default: all)")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)

    from ov_kvcrush.config import CompressionConfig, GenerationSettings
    from ov_kvcrush.engines import make_engine, resolve_model
    from ov_kvcrush.eval.tasks import passkey_prompt

    model = resolve_model("genai", None)
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    engines = {}
    for label, backend, method, options, kw in configs:
        comp = (
            CompressionConfig()
            if method == "full"
            else CompressionConfig(method=method, budget=args.budget, options=options)
        )
        engines[label] = make_engine(backend, model, comp, **kw)
    counter = next(e for e in engines.values() if e.backend == "openvino")
    settings = GenerationSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    runs = []
    t_start = time.time()
    for rep in range(args.repeats):
        sample = passkey_prompt(args.length, lambda t: len(counter.encode(t)), seed=2000 + rep)
        order = configs if rep % 2 == 0 else configs[::-1]
        for label, backend, method, _options, _kw in order:
            r = engines[label].generate(sample.prompt, settings)
            c = r.counters
            decode_ms = r.tpot_ms * max(len(r.token_ids) - 1, 1)
            run = {
                "label": label,
                "backend": backend,
                "method": method,
                "budget": None if method == "full" else args.budget,
                "length": r.prompt_tokens,
                "repeat": rep,
                "ttft_ms": r.ttft_ms,
                "tpot_ms": r.tpot_ms,
                "kv_bytes": r.kv_bytes,
                "correct": bool(sample.score(r.text)),
                "policy_decode_share": c.get("policy_decode_ms", 0.0) / decode_ms if backend == "openvino" else None,
                "policy_prefill_share": c.get("policy_prefill_ms", 0.0) / r.ttft_ms if backend == "openvino" else None,
                "scores_decode_share": c.get("scores_decode_ms", 0.0) / decode_ms if backend == "openvino" else None,
                "hit_rate": c.get("hit_rate"),
            }
            runs.append(run)
            print(
                f"rep {rep} {label:22s} TTFT {r.ttft_ms:7.0f} ms  TPOT {r.tpot_ms:5.1f} ms  "
                f"KV {r.kv_bytes / 2**20:7.2f} MiB  passkey {'ok' if run['correct'] else 'MISSED'}",
                flush=True,
            )
    results = []
    for label, backend, method, options, _kw in configs:
        mine = [x for x in runs if x["label"] == label]
        row = {
            "label": label,
            "backend": backend,
            "method": method,
            "options": options,
            "budget": mine[0]["budget"],
            "length": mine[0]["length"],
            "ttft_ms": statistics.median(x["ttft_ms"] for x in mine),
            "tpot_ms": statistics.median(x["tpot_ms"] for x in mine),
            "kv_bytes": mine[-1]["kv_bytes"],
            "correct": sum(x["correct"] for x in mine),
            "runs": len(mine),
        }
        for key in ("policy_decode_share", "policy_prefill_share", "scores_decode_share"):
            vals = [x[key] for x in mine if x[key] is not None]
            row[key] = statistics.median(vals) if vals else None
        results.append(row)
    base = next((r for r in results if r["label"] == "native full"), None)
    if base:
        for r in results:
            r["tpot_vs_native_full"] = r["tpot_ms"] / base["tpot_ms"]
            r["kv_vs_native_full"] = r["kv_bytes"] / base["kv_bytes"]
    print(
        f"\n{'configuration':22s} {'TTFT ms':>8s} {'TPOT ms':>8s} {'xTPOT':>6s} "
        f"{'KV MiB':>8s} {'xKV':>6s} {'sel/dec':>8s}"
    )
    for r in results:
        share = r["policy_decode_share"]
        print(
            f"{r['label']:22s} {r['ttft_ms']:8.0f} {r['tpot_ms']:8.1f} {r.get('tpot_vs_native_full', 0):6.2f} "
            f"{r['kv_bytes'] / 2**20:8.2f} {r.get('kv_vs_native_full', 0):6.3f} "
            f"{'' if share is None else f'{100 * share:7.2f}%'}"
        )
    write_results(
        argv,
        t_start,
        results,
        runs,
        args.json_out,
        args.plot,
        _plot,
        kv_precision={"genai": "u8 (CPU plugin default)", "openvino": "f16 (2-bit blocks for minikv / quant)"},
    )
    return 0


def _plot(results: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [r["label"] for r in results]
    colours = ["tab:grey" if r["backend"] == "genai" else "tab:blue" for r in results]
    axes[0].barh(labels, [r["tpot_ms"] for r in results], color=colours)
    axes[0].set_xlabel("TPOT (ms, median)")
    axes[1].barh(labels, [r["kv_bytes"] / 2**20 for r in results], color=colours)
    axes[1].set_xlabel("KV held (MiB)")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    n = results[0]["length"]
    b = next((r["budget"] for r in results if r["budget"]), None)
    fig.suptitle(f"{n}-token prompt, budget {b}: our op's methods (blue) vs native openvino_genai (grey)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
