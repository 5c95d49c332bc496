"""Where the CUDA path's time goes: GPU kernel time per decode step and in the prefill, by kind.

For each method, on a random-weight architecture (speed only), one eager generation of one token
(the prefill) and one of ``1 + --steps`` tokens run under torch's profiler; their difference,
divided by the steps, is a decode step's kernel time. Kernels are grouped by kind (matrix
products, attention, Triton kernels, copies and indexing, other element-wise work) and the
largest are listed. The same method's TPOT with CUDA graphs (the engine's default on CUDA) is
measured beside it, so the launch overhead that graphs remove shows as the gap between the two.

    python benchmarks/gpu_profile.py --model random:llama-3-8b --lengths 512,32768 \\
        --methods full,clusterkv --steps 16 --json profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.torch_engine import TorchEngine

KINDS = (
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("triton", ("triton",)),
    ("copy/index", ("copy", "index", "gather", "scatter", "cat", "fill")),
    ("sort/scan", ("sort", "scan", "cumsum", "radix", "topk")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "elementwise/other"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_us(run) -> dict[str, float]:
    """GPU time (µs) per kernel name of ``run()``, under the profiler."""
    sync()
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        run()
        sync()
    out: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out[evt.name] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    return out


def summary(us: dict[str, float], scale: float) -> dict[str, object]:
    kinds: dict[str, float] = defaultdict(float)
    for name, t in us.items():
        kinds[kind_of(name)] += t / scale
    top = sorted(us.items(), key=lambda kv: -kv[1])[:12]
    return {
        "total_ms": round(sum(kinds.values()) / 1e3, 3),
        "by_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_ms": [[name[:110], round(t / scale / 1e3, 4)] for name, t in top],
    }


def text(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(tokens))


def measure(eager: TorchEngine, graphed: TorchEngine, method: str, length: int, steps: int) -> dict[str, object]:
    """One method at one prompt length: kernel times (eager) and TPOT with and without graphs."""
    prompt = text(length - 1, length)
    one = GenerationSettings(max_new_tokens=1, apply_chat_template=False, ignore_eos=True)
    more = GenerationSettings(max_new_tokens=1 + steps, apply_chat_template=False, ignore_eos=True)
    eager.generate(prompt, more)  # warm-up (kernels compiled, allocator grown)
    t0 = time.perf_counter()
    pre = kernel_us(lambda: eager.generate(prompt, one))
    prefill_wall = time.perf_counter() - t0
    both = kernel_us(lambda: eager.generate(prompt, more))
    decode = {k: both.get(k, 0.0) - pre.get(k, 0.0) for k in both}
    res_eager = eager.generate(prompt, more)
    graphed.generate(prompt, more)
    res_graph = graphed.generate(prompt, more)
    return {
        "method": method,
        "length": length,
        "prefill_wall_ms_profiled": round(prefill_wall * 1e3, 1),
        "ttft_ms": round(res_graph.ttft_ms, 1),
        "tpot_ms_eager": round(res_eager.tpot_ms, 2),
        "tpot_ms_graphs": round(res_graph.tpot_ms, 2),
        "counters": {k: v for k, v in res_graph.counters.items() if "ms" in k or "captures" in k},
        "prefill_kernels": summary(pre, 1.0),
        "decode_step_kernels": summary({k: v for k, v in decode.items() if v > 0}, steps),
    }


def _tiles(m: int, n: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}


#: (forward, column sums) launch settings tried by --flash-configs
FLASH_CONFIGS = [
    (_tiles(64, 64, 4, 2), _tiles(64, 64, 4, 2)),
    (_tiles(128, 64, 8, 3), _tiles(64, 128, 8, 3)),
    (_tiles(128, 64, 4, 3), _tiles(128, 64, 4, 3)),
    (_tiles(128, 128, 8, 2), _tiles(128, 128, 8, 2)),
]


def flash_configs(length: int) -> list[dict[str, object]]:
    """The scores kernel's time per launch setting at ``length`` tokens (Llama-3-8B's heads, bf16),
    beside torch's fused causal attention (no scores)."""
    import torch.nn.functional as F

    from ov_kvcrush.kernels import flash_scores

    q = torch.randn(1, 32, length, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 3 * 1e3

    rows = [
        {
            "config": "sdpa causal (no scores)",
            "ms": timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
        }
    ]
    original = flash_scores.launch_config
    for fwd, sums in FLASH_CONFIGS:
        flash_scores.launch_config = lambda d, dev, f=fwd, s=sums: ({**f, "BLOCK_D": 128}, {**s, "BLOCK_D": 128})
        try:
            ms = timed(lambda: flash_scores.flash_attention_with_scores(q, k, v))
            fwd_ms = timed(lambda: flash_scores.flash_attention_with_scores(q, k, v, return_scores=False))
            rows.append({"config": [fwd, sums], "ms": ms, "forward_ms": fwd_ms})
        except Exception as exc:  # a setting that does not fit the GPU: reported, the others still run
            rows.append({"config": [fwd, sums], "error": repr(exc)[:200]})
        print(json.dumps(rows[-1]), flush=True)
    flash_scores.launch_config = original
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--lengths", default="512,32768")
    ap.add_argument("--methods", default="full,clusterkv")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument(
        "--flash-configs", type=int, default=0, help="only time the scores kernel's settings at this length"
    )
    args = ap.parse_args()
    if args.flash_configs:
        rows = flash_configs(args.flash_configs)
        if args.json_out:
            Path(args.json_out).write_text(
                json.dumps({"device": torch.cuda.get_device_name(), "flash": rows}, indent=1)
            )
        return
    cuda = args.device != "cpu"
    rows = []
    for method in args.methods.split(","):
        comp = CompressionConfig(method=method, budget=None if method == "full" else args.budget)
        eager = TorchEngine(args.model, comp, device=args.device, dtype=args.dtype, cuda_graphs=False if cuda else None)
        graphed = TorchEngine(args.model, comp, device=args.device, dtype=args.dtype)
        for length in map(int, args.lengths.split(",")):
            rows.append(measure(eager, graphed, method, length, args.steps))
            print(json.dumps(rows[-1], indent=1), flush=True)
        del eager, graphed
        if cuda:
            torch.cuda.empty_cache()
    if args.json_out:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        Path(args.json_out).write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
