"""Run every registered method's torch reference on one seeded layer and print error and memory vs full.

    python samples/methods_reference.py [--tokens 2048] [--budget 256] [--steps 64]

The inputs are the shared structured test vectors (``ov_kvcrush.methods.vectors``), not a model:
the numbers compare methods on the same synthetic layer, they are not accuracy claims.
"""

from __future__ import annotations

import argparse
import time

import torch

from ov_kvcrush.methods import REGISTRY, method_config
from ov_kvcrush.methods.vectors import layer_vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    prompt = args.tokens - args.steps
    vec = layer_vectors(0, tokens=args.tokens)
    rows = []
    ref = None
    for name in REGISTRY:
        kw = {} if name == "full" else {"budget": args.budget}
        if "dense_layers" in REGISTRY[name].__dataclass_fields__:  # the recall methods: compress every layer
            kw["dense_layers"] = 0
        cache = method_config(name, **kw).make_layer(0, 1)
        t0 = time.perf_counter()
        cache.prefill(*vec.prefix(prompt))
        t1 = time.perf_counter()
        outs = torch.cat([cache.decode(*vec.step(i)) for i in range(prompt, args.tokens)], dim=2)
        t2 = time.perf_counter()
        if ref is None:
            ref, ref_bytes = outs, cache.memory()["kv"]
        err = float((outs - ref).norm() / ref.norm())
        mem = cache.memory()
        rows.append((name, err, mem["kv"] / ref_bytes, mem["total"], (t1 - t0) * 1e3, (t2 - t1) * 1e3 / args.steps))
    print(f"tokens={args.tokens} budget={args.budget} decode steps={args.steps}")
    print(f"{'method':<13}{'rel err':>9}{'kv/full':>9}{'bytes':>11}{'prefill ms':>12}{'step ms':>9}")
    for name, err, ratio, total, pre, step in rows:
        print(f"{name:<13}{err:>9.4f}{ratio:>9.3f}{total:>11}{pre:>12.1f}{step:>9.2f}")


if __name__ == "__main__":
    main()
