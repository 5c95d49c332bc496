"""Where the CUDA path's time goes: GPU kernel time per decode step and in the prefill, by kind.

For each method, on a random-weight architecture (speed only) and one prefill of the prompt
(profiled: the prefill's kernels), ``--steps`` eager decode steps run under torch's profiler
(their kernel time per step), then as many eager steps and steps replayed as CUDA graphs (the
engine's default on CUDA) are timed, so the launch overhead that graphs remove shows as the gap
between the two. The engine's fast path and fused element-wise steps run as the torch engine
runs them on CUDA. Kernels are grouped by kind (matrix products, attention, Triton kernels,
copies and indexing, other element-wise work) and the largest are listed.

    python benchmarks/gpu_profile.py --model random:llama-3-8b --lengths 131000 \\
        --methods full,clusterkv --steps 16 --json profile.json

The same script runs against an older checkout's package (``PYTHONPATH`` first, or a copy of
this file beside it) to profile before a change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.cuda_graph import GraphedDecoder
from ov_kvcrush.engines.hf_cache import CompressedCache

try:  # the fused element-wise steps (absent from the package before them: --before runs it)
    from ov_kvcrush.engines.fused_ops import fuse_model_ops
    from ov_kvcrush.engines.fused_ops import fused_forward as fused
except ImportError:  # pragma: no cover
    fuse_model_ops, fused = None, contextlib.nullcontext
try:
    from ov_kvcrush.engines.torch_model import load_model
except ImportError:  # pragma: no cover
    from ov_kvcrush.engines.torch_engine import load_model

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


def kernel_us(run) -> tuple[dict[str, float], dict[str, int]]:
    """GPU time (µs) and launches per kernel name of ``run()``, under the profiler."""
    sync()
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        run()
        sync()
    out: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out[evt.name] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            launches[evt.name] += 1
    return out, launches


def summary(timed: tuple[dict[str, float], dict[str, int]], scale: float) -> dict[str, object]:
    """Kernel time by kind and the largest kernels, per ``scale`` (steps); the launches too (the
    gaps between a replayed graph's kernels grow with them)."""
    us, launches = timed
    kinds: dict[str, float] = defaultdict(float)
    for name, t in us.items():
        kinds[kind_of(name)] += t / scale
    top = sorted(us.items(), key=lambda kv: -kv[1])[:20]
    return {
        "total_ms": round(sum(kinds.values()) / 1e3, 3),
        "launches": round(sum(launches.values()) / scale, 1),
        "by_kind_ms": {k: round(v / 1e3, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_ms": [[name[:110], round(t / scale / 1e3, 4), round(launches[name] / scale, 1)] for name, t in top],
    }


def graphed_step(decoder: GraphedDecoder, tokens: list[int], position: int) -> torch.Tensor:
    """One replayed step, a token per row (an older package's step took one sequence's token)."""
    try:
        return decoder.step(tokens, position)
    except TypeError:
        return decoder.step(tokens[0], position)  # type: ignore[arg-type]


def measure(model, method: str, budget: int, length: int, steps: int, batch: int = 1) -> dict[str, object]:
    """One method at one prompt length, on one prefill of ``batch`` rows (each its own prompt):
    the prefill's kernels, then ``steps`` eager decode steps' kernels (per step), then TPOT
    eager and replayed as CUDA graphs (one step decodes a token for every row)."""
    comp = CompressionConfig(method=method, budget=None if method == "full" else budget)
    cache = CompressedCache(comp.method_config(), model.config, fast_path=True, reserve=4 * steps + 8)
    ids = torch.tensor(
        [[3 + (i * 7919 + row * 104729) % 250 for i in range(length)] for row in range(batch)], device=model.device
    )

    def forward(x: torch.Tensor, position: int | None = None) -> torch.Tensor:
        with torch.inference_mode(), fused():
            kw = {} if position is None else {"position_ids": torch.full((batch, 1), position, device=model.device)}
            return model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw).logits

    t0 = time.perf_counter()
    holder: dict[str, torch.Tensor] = {}
    pre = kernel_us(lambda: holder.update(logits=forward(ids)) or cache.finish_prefill())
    prefill_wall = time.perf_counter() - t0
    token, position = int(holder["logits"].reshape(-1, holder["logits"].shape[-1])[0].argmax()), length

    def eager_steps(n: int) -> None:
        nonlocal position
        for _ in range(n):
            forward(torch.full((batch, 1), token, device=model.device), position)
            position += 1

    eager_steps(2)  # kernels compiled, allocator grown
    decode = kernel_us(lambda: eager_steps(steps))
    sync()
    t0 = time.perf_counter()
    eager_steps(steps)
    sync()
    tpot_eager = (time.perf_counter() - t0) / steps
    tpot_graphs, captures = None, 0
    if model.device.type == "cuda":
        # an older package's decoder (``--before``) takes no row count: one sequence only
        decoder = GraphedDecoder(model, cache, batch) if batch > 1 else GraphedDecoder(model, cache)
        with fused():
            for _ in range(2):  # the capture, then a replay
                graphed_step(decoder, [token] * batch, position)
                position += 1
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                graphed_step(decoder, [token] * batch, position)
                position += 1
            sync()
        tpot_graphs, captures = round((time.perf_counter() - t0) / steps * 1e3, 2), decoder.captures
    return {
        "method": method,
        "length": length,
        "batch": batch,
        "prefill_wall_ms_profiled": round(prefill_wall * 1e3, 1),
        "tpot_ms_eager": round(tpot_eager * 1e3, 2),
        "tpot_ms_graphs": tpot_graphs,
        "graph_captures": captures,
        "kv_read_bytes": cache.decode_read_bytes() if hasattr(cache, "decode_read_bytes") else None,
        "prefill_kernels": summary(pre, 1.0),
        "decode_step_kernels": summary(decode, steps),
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
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (one prompt each)")
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
    model, _ = load_model(args.model, args.device, args.dtype)
    if fuse_model_ops is not None and cuda:
        fuse_model_ops(model)
    rows = []
    for method in args.methods.split(","):
        for length in map(int, args.lengths.split(",")):
            rows.append(measure(model, method, args.budget, length, args.steps, args.batch))
            print(json.dumps(rows[-1], indent=1), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if args.json_out:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        Path(args.json_out).write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
