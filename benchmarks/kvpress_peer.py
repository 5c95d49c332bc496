"""KVzip as a peer implements it (kvpress), on our needle prompts: issue 25's side-by-side check.

kvpress 0.5.5 needs transformers < 5.3, so it runs in a venv of its own, on the embedded model's
transformers copy (the torch engine's ``resolve_model("torch", None)`` directory), float32 on
the CPU. Two steps, the first in the project's venv, the second in kvpress's:

    .venv/bin/python benchmarks/kvpress_peer.py dump --length 6144 --samples 24 --out niah.jsonl
    python3 -m venv /tmp/kvp && /tmp/kvp/bin/pip install torch==2.13.0 && \\
        /tmp/kvp/bin/pip install kvpress==0.5.5 "transformers<5.3" protobuf sentencepiece
    /tmp/kvp/bin/python benchmarks/kvpress_peer.py run --data niah.jsonl --first 12 --budget 1024 \\
        --model ~/.cache/ov_kvcrush/models/SmolLM2-135M-Instruct.Q4_1-hf-<hash> --json out.json

``dump`` writes the prompts ``ov-kvcrush eval --tasks niah_single --samples N --question-after``
asks (same generator, seed 0), split at the question; ``run`` compresses each context to about
``--budget`` tokens with kvpress's ``KVzipPress`` (its defaults: chunks of 2048, 4 sinks, the
budget shared across layers and heads), then asks the question, as kvpress's pipeline does.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def dump(length: int, samples: int, out: str) -> None:
    from ov_kvcrush.eval import tasks
    from ov_kvcrush.serving.backends import resolve_model
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    tok = OpenVINOEngine(resolve_model("openvino", None)).tokenizer
    count = lambda t: len(tok.encode(t, add_special_tokens=False).input_ids.data[0])  # noqa: E731
    with open(out, "w") as f:
        for i in range(samples):
            s = tasks.GENERATION_TASKS["niah_single"](length, count, 0, i, samples)
            row = {"index": i, "document": s.prompt[: -len(s.question)], "question": s.question, "answer": s.answers[0]}
            f.write(json.dumps(row) + "\n")


def run(data: str, first: int, budget: int, model_dir: str, new_tokens: int, out: str) -> None:
    import torch
    from kvpress import KVzipPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    rows = [json.loads(line) for line in open(data)][:first]
    results = []
    for r in rows:
        n = len(tok(r["document"]).input_ids)
        press = KVzipPress(compression_ratio=max(0.0, 1 - budget / n))
        t0 = time.time()
        answer = pipe(r["document"], question=r["question"], press=press, max_new_tokens=new_tokens)["answer"]
        results.append(
            {"index": r["index"], "answer": r["answer"], "output": answer, "correct": r["answer"] in answer,
             "context_tokens": n, "seconds": round(time.time() - t0, 1)}
        )  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    summary = {"answered": sum(x["correct"] for x in results), "of": len(results), "budget": budget}
    doc = {"peer": "kvpress 0.5.5 KVzipPress", "summary": summary, "rows": results}
    Path(out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--length", type=int, default=6144)
    d.add_argument("--samples", type=int, default=24)
    d.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--first", type=int, default=12)
    r.add_argument("--budget", type=int, default=1024)
    r.add_argument("--model", required=True)
    r.add_argument("--new-tokens", type=int, default=48)
    r.add_argument("--json", required=True)
    a = p.parse_args()
    if a.cmd == "dump":
        dump(a.length, a.samples, a.out)
    else:
        run(a.data, a.first, a.budget, a.model, a.new_tokens, a.json)


if __name__ == "__main__":
    main()
