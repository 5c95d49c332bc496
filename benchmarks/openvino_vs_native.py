"""Full-cache speed of the openvino engine (our paged-attention op) against native openvino_genai.

Both run the same exported IR of the embedded model on the CPU with the plugin's default
properties (bf16 inference precision where the CPU has it; int8 weights). Each repeat uses a
fresh passkey prompt (another seed), so native prefix caching cannot help (it is off in our
genai engine anyway), and the two engines alternate within every repeat, so machine noise hits
both alike. Reported: median TTFT and TPOT over the repeats, their ratios to native, and the KV
bytes each holds (native: u8 with scales; ours: f16 by default).

    python benchmarks/openvino_vs_native.py --lengths 2048,4096 --repeats 5 \\
        --json docs/results/openvino_vs_native.json --plot docs/results/openvino_vs_native.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from run_info import write_results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096", help="prompt lengths in tokens (default 2048,4096)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed per run (EOS ignored)")
    ap.add_argument("--kv-precision", default="f16", help="our cache: f16 (default) or f32")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)

    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.engines import make_engine, resolve_model
    from ov_kvcrush.eval.tasks import passkey_prompt

    lengths = [int(x) for x in args.lengths.split(",")]
    model = resolve_model("genai", None)
    engines = {
        "genai": make_engine("genai", model),
        "openvino": make_engine("openvino", model, kv_precision=args.kv_precision),
    }
    ours = engines["openvino"]
    # the same number of decode steps on both engines, whatever the answer's length
    settings = GenerationSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    runs = []
    t_start = time.time()
    for length in lengths:
        for rep in range(args.repeats):
            sample = passkey_prompt(length, lambda t: len(ours.encode(t)), seed=1000 + rep)
            for name in ("genai", "openvino") if rep % 2 == 0 else ("openvino", "genai"):
                r = engines[name].generate(sample.prompt, settings)
                runs.append(
                    {
                        "backend": name,
                        "length": length,
                        "repeat": rep,
                        "prompt_tokens": r.prompt_tokens,
                        "new_tokens": len(r.token_ids),
                        "ttft_ms": r.ttft_ms,
                        "tpot_ms": r.tpot_ms,
                        "kv_bytes": r.kv_bytes,
                        "correct": bool(sample.score(r.text)),
                    }
                )
                print(
                    f"{length:5d} rep {rep} {name:8s} TTFT {r.ttft_ms:7.0f} ms  TPOT {r.tpot_ms:5.1f} ms  "
                    f"({len(r.token_ids)} tokens) KV {r.kv_bytes / 2**20:6.2f} MiB",
                    flush=True,
                )
    results = []
    for length in lengths:
        row = {"length": length}
        for name in engines:
            mine = [x for x in runs if x["backend"] == name and x["length"] == length]
            row[name] = {
                "ttft_ms": statistics.median(x["ttft_ms"] for x in mine),
                "tpot_ms": statistics.median(x["tpot_ms"] for x in mine),
                "kv_bytes": mine[-1]["kv_bytes"],
                "correct": sum(x["correct"] for x in mine),
                "runs": len(mine),
            }
        row["ttft_ratio"] = row["openvino"]["ttft_ms"] / row["genai"]["ttft_ms"]
        row["tpot_ratio"] = row["openvino"]["tpot_ms"] / row["genai"]["tpot_ms"]
        results.append(row)
    print("\nlength  TTFT native / ours (ratio)     TPOT native / ours (ratio)")
    for row in results:
        g, o = row["genai"], row["openvino"]
        print(
            f"{row['length']:6d}  {g['ttft_ms']:6.0f} / {o['ttft_ms']:6.0f} ms ({row['ttft_ratio']:.2f}x)   "
            f"{g['tpot_ms']:5.1f} / {o['tpot_ms']:5.1f} ms ({row['tpot_ratio']:.2f}x)"
        )
    write_results(
        argv,
        t_start,
        results,
        runs,
        args.json_out,
        args.plot,
        _plot,
        attention_compute=ours.attention_compute,
        kv_precision={"genai": "u8 (CPU plugin default)", "openvino": args.kv_precision},
    )
    return 0


def _plot(results: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    xs = [r["length"] for r in results]
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for name, marker in (("genai", "o"), ("openvino", "s")):
            ax.plot(xs, [r[name][key] for r in results], marker=marker, label=name)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    for name, marker in (("genai", "o"), ("openvino", "s")):
        axes[2].plot(xs, [r[name]["kv_bytes"] / 2**20 for r in results], marker=marker, label=name)
    axes[2].set_xlabel("prompt tokens")
    axes[2].set_ylabel("KV held (MiB)")
    axes[2].grid(alpha=0.3)
    axes[2].legend()
    fig.suptitle("full cache: openvino engine (our op) vs native openvino_genai, medians")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
