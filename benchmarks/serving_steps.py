"""Where a serving run's time goes: our continuous batching's steps, one by one.

``ov-kvcrush bench --concurrency`` reports a run's tokens/s; this says why. The same workload
(``--concurrency`` prompts of ``--length`` random token ids arriving together, ``--new-tokens``
each, a ``--kv-pool-mib`` pool, 256 tokens a step) runs through our
:class:`~ov_kvcrush.serving.ContinuousBatchingPipeline` per method, and every inference is timed
with what it carried: a prompt chunk (with the decode rows beside it) or a decode step of ``n``
sequences. The JSON has, per method: wall time and tokens/s, the prompt steps' count and time,
and the decode steps grouped by their row count (steps, median ms). The row counts show how many
sequences the pool let decode together, and in how many waves.

Run on an idle machine::

    .venv/bin/python benchmarks/serving_steps.py --methods snapkv,snapkv:block_size=32+4bit \\
        --budget 512 --json docs/results/serving/serving_steps_16x1k_op_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def run(method: str, a: argparse.Namespace) -> dict[str, Any]:
    import openvino_genai as ov_genai

    from ov_kvcrush.config import GenerationSettings, MethodSpec
    from ov_kvcrush.op.kvcache import block_bytes, pool_blocks
    from ov_kvcrush.serving import ContinuousBatchingPipeline
    from ov_kvcrush.serving.backends import resolve_model
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    spec = MethodSpec.parse(method)
    engine = OpenVINOEngine(resolve_model("openvino", None), spec.compression(a.budget, track_recall=False))
    one = block_bytes(engine.block_size, engine.shape.head_dim, engine.kv_precision)
    engine.max_kv_blocks = pool_blocks(int(a.kv_pool_mib * 2**20), one)  # as `bench --concurrency` sizes it
    engine.set_compression(engine.compression)  # the pool, with its limit
    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = a.max_num_batched_tokens
    pipe = ContinuousBatchingPipeline(engine, sc)
    warm = GenerationSettings(max_new_tokens=4, ignore_eos=True, apply_chat_template=False)
    pipe.add_request(10**6, list(range(100, 164)), warm)
    while pipe.has_non_finished_requests():
        pipe.step()
    steps: list[tuple[int, int, float]] = []  # (sequences, tokens, seconds) per inference
    pipe.trace = steps
    rng = random.Random(a.seed)
    settings = GenerationSettings(max_new_tokens=a.new_tokens, ignore_eos=True, apply_chat_template=False)
    for i in range(a.concurrency):
        pipe.add_request(i, [rng.randrange(1000, 30000) for _ in range(a.length)], settings)
    t0 = time.perf_counter()
    while pipe.has_non_finished_requests():
        pipe.step()
    wall = time.perf_counter() - t0
    decode: dict[int, list[float]] = defaultdict(list)
    prompt = [s for n, tok, s in steps if tok > n]
    for n, tok, s in steps:
        if tok == n:
            decode[n].append(s)
    return {
        "method": method,
        "budget": a.budget,
        "wall_s": round(wall, 2),
        "throughput_tps": round(a.concurrency * a.new_tokens / wall, 1),
        "prompt_steps": len(prompt),
        "prompt_steps_s": round(sum(prompt), 2),
        "decode": [
            {"rows": n, "steps": len(v), "median_ms": round(1000 * statistics.median(v), 1), "sum_s": round(sum(v), 2)}
            for n, v in sorted(decode.items())
        ],
        "stats": dict(pipe.stats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="snapkv", help="comma-separated, as ov-kvcrush bench names them")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kv-pool-mib", type=float, default=70.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    rows = []
    for method in a.methods.split(","):
        row = run(method, a)
        big = [d for d in row["decode"] if d["steps"] > 10]  # the waves (a row count held for many steps)
        waves = ", ".join(f"{d['rows']} rows x {d['steps']} steps at {d['median_ms']} ms" for d in big)
        print(f"{method} @{a.budget}: {row['throughput_tps']} tok/s, prompt steps {row['prompt_steps_s']} s; {waves}")
        rows.append(row)
    doc = {"command": "benchmarks/serving_steps.py " + " ".join(f"{k}={v}" for k, v in vars(a).items()), "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
