"""What one inference of our op's model costs by its token count: the basis of
``step_inputs.FAST_STEP_TOKENS`` (a first prompt fed as a multiple of 128 tokens and the rest)
and of KVzip's ``step_multiple`` (its scoring steps).

Two tables, on the embedded model with the full cache, same process, interleaved repeats:

* ``steps``: a step of ``n`` tokens after 64 held tokens, for ``n`` around multiples of 128;
* ``prompts``: a prompt of ``n`` tokens fed whole (one inference) against the engine's
  :meth:`~ov_kvcrush.serving.openvino_engine.OpenVINOEngine.prefill` (a multiple of 128, then
  the rest, as two chunks of one prompt).

Run on an idle machine::

    .venv/bin/python benchmarks/step_sizes.py --json docs/results/bench/step_sizes_op_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ov_kvcrush.config import MethodSpec
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.serving.backends import resolve_model
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

STEPS = "256,320,384,448,480,496,512,528,544,576,640,768,1024"
PROMPTS = "1000,2000,3059,3089,4000,6000"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def summary(name: str, ms: list[float]) -> dict[str, float]:
    return {f"{name}_min": round(min(ms), 1), f"{name}_median": round(statistics.median(ms), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default=STEPS, help="step token counts after 64 held tokens")
    p.add_argument("--prompts", default=PROMPTS, help="prompt token counts, whole against cut")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    engine = OpenVINOEngine(resolve_model("openvino", None))
    engine.set_compression(MethodSpec.parse("full").compression(None, track_recall=False))
    tok = engine.tokenizer
    count = lambda t: len(tok.encode(t, add_special_tokens=False).input_ids.data[0])  # noqa: E731
    ids = engine.encode(T.GENERATION_TASKS["niah_single"](8000, count, 0, 0, 1).prompt)

    def timed(feed: list[list[int]], prefill: bool) -> float:
        engine.finish_chat()  # an empty sequence (no chat is open)
        for part in feed[:-1]:
            engine.forward(part)
        t0 = time.perf_counter()
        (engine.prefill if prefill else engine.forward)(feed[-1])
        return (time.perf_counter() - t0) * 1e3

    steps = []
    for n in ints(a.steps):
        ms = [timed([ids[:64], ids[64 : 64 + n]], False) for _ in range(a.repeats)]
        steps.append({"tokens": n, **summary("ms", ms), "ms_per_token": round(min(ms) / n, 4)})
        print(json.dumps(steps[-1]), flush=True)
    prompts = []
    for n in ints(a.prompts):
        whole, cut = [], []
        for _ in range(a.repeats):
            whole.append(timed([ids[:n]], False))
            cut.append(timed([ids[:n]], True))
        prompts.append({"tokens": n, **summary("whole_ms", whole), **summary("cut_ms", cut)})
        print(json.dumps(prompts[-1]), flush=True)
    command = "benchmarks/step_sizes.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items())
    Path(a.json).write_text(json.dumps({"command": command, "steps": steps, "prompts": prompts}, indent=1))


if __name__ == "__main__":
    main()
