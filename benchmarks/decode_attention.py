"""One decode step's attention through our op, in the embedded model after an N-token prompt: the
step's wall time and the op's own attention clock (``attend_decode_ns``), per step, for A/B runs
of decode kernel changes (``OV_KVCRUSH_PLUGIN=other.so`` loads another build of the op). The
default u8 store; random token ids (the kernels' time does not depend on the text).

    .venv/bin/python benchmarks/decode_attention.py 8000 40
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ov_kvcrush.serving.backends import resolve_model
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, nargs="?", default=8000, help="the prompt's length")
    parser.add_argument("steps", type=int, nargs="?", default=40, help="decode steps timed")
    a = parser.parse_args()
    engine = OpenVINOEngine(resolve_model("openvino", None))
    ids = [int(x) for x in np.random.default_rng(0).integers(100, 20000, a.tokens + a.steps)]
    engine.prefill(ids[: a.tokens])
    before = engine.sequence.stats()
    t0 = time.perf_counter()
    for i in range(a.steps):
        engine.forward([ids[a.tokens + i]])
    step_ms = (time.perf_counter() - t0) / a.steps * 1e3
    attend_ms = (engine.sequence.stats().attend_decode_ns - before.attend_decode_ns) / a.steps / 1e6
    print(f"{a.tokens} tokens, {engine.kv_precision}: a step {step_ms:.1f} ms, the op's attention {attend_ms:.1f} ms")


if __name__ == "__main__":
    main()
