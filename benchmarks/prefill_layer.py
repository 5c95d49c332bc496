"""One layer's prompt attention through our op alone (no model around it): the time of the bf16
prefill kernel at N tokens, on the embedded model's shape (9 query heads over 3 KV heads, head
size 64), for A/B runs of kernel changes. Random queries, keys and values; an f32 pool.

    .venv/bin/python benchmarks/prefill_layer.py 8000 5 [--compute f32] [--products dot|widened]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ov_kvcrush.op import kvcache, plugin
from ov_kvcrush.op.probe import single_op_model

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, nargs="?", default=8000)
    parser.add_argument("runs", type=int, nargs="?", default=5)
    parser.add_argument("--compute", choices=("bf16", "f32"), default="bf16", help="the op's prompt arithmetic")
    parser.add_argument("--products", choices=plugin.BF16_PRODUCTS, help="how bf16 multiplies (default: measured)")
    a = parser.parse_args()
    if a.products:
        plugin.set_bf16_products(a.products)
    request = single_op_model(plugin.shared_core(), Q_HEADS, KV_HEADS, HEAD_DIM, compute=a.compute)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, Q_HEADS, a.tokens, HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((1, KV_HEADS, a.tokens, HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((1, KV_HEADS, a.tokens, HEAD_DIM), dtype=np.float32)
    times, attend = [], []
    for _ in range(a.runs):
        seq = kvcache.KVPool(1, Q_HEADS, KV_HEADS, HEAD_DIM, precision="f32").new_sequence()
        t0 = time.perf_counter()
        kvcache.infer_steps(request, {"q": q, "k": k, "v": v, "kvc_sequence": np.array([seq.handle])}, [seq.handle])
        times.append(time.perf_counter() - t0)
        attend.append(seq.stats().attend_prefill_ns / 1e9)
    macs = 2 * Q_HEADS * HEAD_DIM * a.tokens * a.tokens / 2  # QK and PV over the causal half
    best, median = min(times), sorted(times)[len(times) // 2]
    print(
        f"{a.tokens} tokens, {a.compute} ({plugin.bf16_products()} products): fastest {best * 1e3:.1f} ms "
        f"(median {median * 1e3:.1f}, "
        f"the op's attention clock {min(attend) * 1e3:.1f}), {macs / best / 1e9:.0f} GMAC/s"
    )


if __name__ == "__main__":
    main()
