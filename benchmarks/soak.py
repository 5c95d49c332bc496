"""Soak: many generate calls in one process, the resident memory recorded after each one.

A leak in the op's block pool, a sequence never freed or a cache kept per call shows as RSS that
keeps climbing; a healthy engine levels off after its first calls (compiled model, pool, first
allocations). Every call gets another prompt (length and content) and the methods take turns, each
on its own pipeline, as a server would hold them.

    python benchmarks/soak.py --calls 500 --json docs/results/soak/soak_cpu.json --plot docs/results/soak/soak_cpu.png
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time

from ov_kvcrush import CompressionConfig, LLMPipeline
from ov_kvcrush.bench.measure import RssSampler, describe_run
from ov_kvcrush.outputs import PLOT_SUFFIXES, prepare_output, write_atomic, write_text

METHODS = (("full", None), ("snapkv", 256), ("kvcrush", 256), ("h2o", 256), ("minikv", 256), ("chelsea", 256))
WARM_CALLS_PER_PIPELINE = 5
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def prompt(rng: random.Random, fixed_words: int = 0) -> str:
    """A fresh prompt: ``fixed_words`` words (0: 20 to 600, so the input shapes vary too)."""
    words = fixed_words or rng.randint(20, 600)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummarise the text above in one sentence."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-words", type=int, default=0, help="every prompt this long (default 0: 20-600 words)")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    json_out = prepare_output("--json", args.json_out)
    plot_out = prepare_output("--plot", args.plot, PLOT_SUFFIXES)
    rng = random.Random(args.seed)
    pipes = [
        (f"{m}" + (f"@{b}" if b else ""), LLMPipeline(backend=args.backend, compression=CompressionConfig(m, b)))
        for m, b in METHODS
    ]
    after_load = RssSampler.rss()
    rows = []
    t0 = time.time()
    for i in range(args.calls):
        label, pipe = pipes[i % len(pipes)]
        r = pipe.generate(prompt(rng, args.prompt_words), max_new_tokens=args.new_tokens, ignore_eos=True)
        rows.append({"call": i, "method": label, "prompt_tokens": r.prompt_tokens, "rss_bytes": RssSampler.rss()})
        if i % 50 == 0:
            mib = rows[-1]["rss_bytes"] / 2**20
            print(f"[{i}/{args.calls}] {label:14s} {r.prompt_tokens:4d} tokens  RSS {mib:.0f} MiB")
    rss = [r["rss_bytes"] for r in rows]
    # warm: every pipeline has served a few calls (compiled model, pool and buffers in place)
    warm = min(len(rss), WARM_CALLS_PER_PIPELINE * len(pipes))
    doc = {
        **describe_run(),
        "backend": args.backend,
        "prompt_words": args.prompt_words or "20-600",
        "calls": args.calls,
        "wall_s": round(time.time() - t0, 1),
        "rss_after_load_bytes": after_load,
        "warm_calls": warm,
        "rss_warm_bytes": max(rss[:warm]),
        "rss_end_bytes": rss[-1],
        "rss_max_bytes": max(rss),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rows": rows,
    }
    growth = (doc["rss_max_bytes"] - doc["rss_warm_bytes"]) / 2**20
    print(
        f"RSS: {after_load / 2**20:.0f} MiB after load, {doc['rss_warm_bytes'] / 2**20:.0f} MiB warm "
        f"(after {warm} calls), {doc['rss_end_bytes'] / 2**20:.0f} MiB at the end; growth past warm {growth:+.1f} MiB"
    )
    if json_out is not None:
        write_text(json_out, json.dumps(doc, indent=1))
    if plot_out is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.plot([r["call"] for r in rows], [r["rss_bytes"] / 2**20 for r in rows], lw=1)
        lengths = f"{args.prompt_words} words" if args.prompt_words else "20-600 words"
        title = f"soak: {args.calls} generate calls, backend {args.backend}, {len(pipes)} methods, prompts {lengths}"
        ax.set(xlabel="generate call", ylabel="resident memory (MiB)", title=title)
        ax.axvline(warm, color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        write_atomic(plot_out, lambda p: fig.savefig(p, dpi=110))
    return 0


if __name__ == "__main__":
    sys.exit(main())
