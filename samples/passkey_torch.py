"""Every method on the torch engine: passkey found?, TTFT, TPOT and KV held, at one budget.

python samples/passkey_torch.py --tokens 2000 --budget 256 [--device cuda] [--json out.json]
python samples/passkey_torch.py --plot out.json   # redraw out.png

Several seeds (key depths) per method give a small hit rate rather than one lucky answer. The
model is loaded once; only the method changes between runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import textwrap

from ov_kvcrush import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.torch_engine import TorchEngine
from ov_kvcrush.eval.tasks import passkey_prompt
from ov_kvcrush.methods import REGISTRY
from ov_kvcrush.models.export import hf_checkpoint


def plot(json_path: str) -> str:
    """Bars per method: passkey hits, KV held (% of full) and TPOT; written beside the JSON as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as fh:
        data = json.load(fh)
    rows = data["rows"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series = [
        ("passkey found", [r["found"] / r["prompts"] for r in rows], "share of prompts"),
        ("KV held", [100 * r["kv_ratio"] for r in rows], "% of the full cache"),
        ("TPOT", [r["tpot_ms"] for r in rows], "ms per token"),
    ]
    for ax, (title, values, unit) in zip(axes, series, strict=True):
        ax.bar(names, values, color="tab:blue")
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", rotation=60)
    title = f"torch engine, {data['prompt_tokens']}-token passkey prompts ({data['machine']}): {data['command']}"
    fig.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=9)
    fig.tight_layout()
    out = json_path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3, help="passkey prompts per method (key depths 0.25..0.75)")
    ap.add_argument("--methods", default=",".join(REGISTRY), help="comma-separated; name+2bit adds the 2-bit store")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--json", dest="json_out", help="write the rows as JSON (and a PNG beside it)")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the PNG of an earlier --json file")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    engine = TorchEngine(hf_checkpoint(), device=args.device)
    depths = [0.25 + 0.5 * i / max(args.seeds - 1, 1) for i in range(args.seeds)]
    samples = [
        passkey_prompt(args.tokens, lambda t: len(engine.encode(t)), seed=s, depth=d) for s, d in enumerate(depths)
    ]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    engine.generate(samples[0].prompt, GenerationSettings(max_new_tokens=2))  # warm-up: first-call costs
    rows = []
    print(f"{'method':16s} found  TTFT ms  TPOT ms  KV MiB  of full  counters")
    for spec in args.methods.split(","):
        name, quant = (spec[:-5], True) if spec.endswith("+2bit") else (spec, False)
        cfg = CompressionConfig(
            method=name,
            budget=args.budget if REGISTRY[name].needs_budget else None,
            options={"quant": True} if quant else {},
        )
        engine.set_compression(cfg)
        results = [engine.generate(s.prompt, settings) for s in samples]
        found = sum(s.score(r.text) for s, r in zip(samples, results, strict=True))
        mean = {k: sum(getattr(r, k) for r in results) / len(results) for k in ("ttft_ms", "tpot_ms", "kv_ratio")}
        last = results[-1]
        shown = {k: v for k, v in last.counters.items() if k in ("evicted", "merges", "hit_rate", "tokens_loaded")}
        print(
            f"{spec:16s} {int(found)}/{len(samples)}  {mean['ttft_ms']:7.0f}  {mean['tpot_ms']:7.1f}  "
            f"{last.kv_bytes / 2**20:6.2f}  {100 * mean['kv_ratio']:5.1f} %  {shown}",
            flush=True,
        )
        rows.append(
            {
                "method": spec,
                "found": found,
                "prompts": len(samples),
                **mean,
                "answers": [r.text for r in results],
                "kv_bytes": last.kv_bytes,
                "full_kv_bytes": last.full_kv_bytes,
                "counters": last.counters,
            }
        )
    if args.json_out:
        flags = " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("json_out", "plot") and v
        )
        meta = {
            "command": f"python samples/passkey_torch.py {flags}",
            "machine": platform.processor() or platform.machine(),
            "prompt_tokens": results[0].prompt_tokens,
        }
        with open(args.json_out, "w") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=1)
        print(plot(args.json_out))


if __name__ == "__main__":
    main()
