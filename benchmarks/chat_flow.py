"""Questions asked in the next chat turn (issue 25's table): our op, backend openvino.

Each needle prompt (``niah_single``) is split at its question: turn 1 is the document plus
"Read the text above. Reply with OK.", turn 2 the question. Writes a JSON of answers per method
and the turns' TTFT. Run on an idle machine for the timings::

    .venv/bin/python benchmarks/chat_flow.py --length 3072 --samples 6 --budget 1024 \\
        --json docs/results/quality/chat_flow_3k_op_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ov_kvcrush.config import GenerationSettings, MethodSpec
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.serving.backends import resolve_model
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

#: the methods of issue 25's table; ``--methods`` takes eval's spellings (``kvzip+4bit``)
METHODS = "full,snapkv,kvcrush:block_size=32,kvcrush,kvzip"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=3072)
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--methods", default=METHODS, help="comma-separated, as `ov-kvcrush eval --methods`")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    specs = [MethodSpec.parse(m.strip()) for m in a.methods.split(",")]
    engine = OpenVINOEngine(resolve_model("openvino", None))
    tok = engine.tokenizer
    count = lambda t: len(tok.encode(t, add_special_tokens=False).input_ids.data[0])  # noqa: E731
    settings = GenerationSettings(max_new_tokens=24)
    rows = []
    for i in range(a.samples):
        s = T.GENERATION_TASKS["niah_single"](a.length, count, 0, i, a.samples)
        document = s.prompt[: -len(s.question)]
        for spec in specs:
            label = spec.label
            engine.set_compression(spec.compression(None if spec.method == "full" else a.budget, track_recall=False))
            engine.start_chat()
            first = engine.generate(document + "\n\nRead the text above. Reply with OK.", settings)
            second = engine.generate(s.question.strip(), settings)
            engine.finish_chat()
            row = {
                "sample": i,
                "method": label,
                "answer": s.answers[0],
                "output": second.text,
                "correct": s.score(second.text),
                "turn1_tokens": first.prompt_tokens,
                "turn1_ttft_ms": round(first.ttft_ms, 1),
                "turn1_scoring_pass_ms": first.counters.get("scoring_pass_ms"),
                "turn2_ttft_ms": round(second.ttft_ms, 1),
                "kv_ratio": round(second.kv_ratio, 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for label in (spec.label for spec in specs):
        mine = [r for r in rows if r["method"] == label]
        summary[label] = {
            "answered": sum(r["correct"] for r in mine),
            "of": len(mine),
            "turn1_ttft_ms_mean": round(sum(r["turn1_ttft_ms"] for r in mine) / len(mine), 1),
        }
    print(json.dumps(summary, indent=1))
    out = {"command": "benchmarks/chat_flow.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
           "summary": summary, "rows": rows}  # fmt: skip
    Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
