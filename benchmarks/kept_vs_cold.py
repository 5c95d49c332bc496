"""A conversation's later question through the server's kept cache against the same history sent
cold (issue 73's target: equal answers on at least 90 % of conversations). The full cache's kept
cache is its sequence; another method's a held prompt (ov_kvcrush/serving/kept.py).

Each conversation is a needle document (``niah_single``) in turn one ("Reply with OK."), for every
other conversation a second turn about something else, and the needle's question in the last
turn. Each conversation's last answer is asked twice of one in-process server, through the
``openai`` client: continuing its kept cache, then with the kept caches dropped (a cold prefill of
the same history). Writes a JSON of both answers, whether they are equal and correct, and the
last turn's TTFT both ways::

    .venv/bin/python benchmarks/kept_vs_cold.py --length 3000 --conversations 10 --budget 256 \\
        --json docs/results/serving/kept_vs_cold_kvzip_256.json
    .venv/bin/python benchmarks/kept_vs_cold.py ... --method snapkv --json ..._snapkv_256.json
    .venv/bin/python benchmarks/kept_vs_cold.py ... --method full --json docs/results/serving/kept_vs_cold_full.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import openai

from ov_kvcrush.cli.main import build_parser
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.server.app import make_app
from ov_kvcrush.server.config import ServerConfig
from ov_kvcrush.server.factory import build_backend
from ov_kvcrush.server.thread import ServerThread

ASIDE = "Thanks. In one short sentence, what kind of text was that?"


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int = 24) -> tuple[str, dict]:
    """The greedy answer, and its prompt tokens, those continued from a kept cache, and its TTFT."""
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    u = r.usage
    usage = {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.prompt_tokens_details.cached_tokens,
             "ttft_ms": u.model_extra["ttft_ms"]}  # fmt: skip
    return r.choices[0].message.content or "", usage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=3000, help="the document's tokens")
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--method", default=None, help="the server's --method (default: --budget alone, KVzip)")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    argv = [
        "serve",
        "--budget",
        str(a.budget),
        "--served-model-name",
        "m",
        *(["--method", a.method] if a.method else []),
    ]
    backend = build_backend(ServerConfig.from_args(build_parser().parse_args(argv)))
    pipeline = backend.pipeline
    count = pipeline.engine.count_tokens
    rows = []
    with ServerThread(make_app(backend)) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        for i in range(a.conversations):
            sample = T.GENERATION_TASKS["niah_single"](a.length, count, 0, i, a.conversations)
            document = sample.prompt[: -len(sample.question)]
            messages = [{"role": "user", "content": document + "\n\nRead the text above. Reply with OK."}]
            answer, _ = ask(client, messages)
            messages.append({"role": "assistant", "content": answer})
            if i % 2:  # the question in turn three
                messages.append({"role": "user", "content": ASIDE})
                answer, _ = ask(client, messages)
                messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": sample.question.strip()})
            kept, kept_usage = ask(client, messages)
            pipeline.kept.clear()  # the same history again, prefilled cold
            cold, cold_usage = ask(client, messages)
            pipeline.kept.clear()
            row = {
                "conversation": i, "turns": len(messages) // 2 + 1, "answer": sample.answers[0],
                "kept": kept, "cold": cold, "equal": kept == cold,
                "kept_correct": bool(sample.score(kept)), "cold_correct": bool(sample.score(cold)),
                "kept_cached_tokens": kept_usage["cached_tokens"], "prompt_tokens": kept_usage["prompt_tokens"],
                "kept_ttft_ms": kept_usage["ttft_ms"], "cold_ttft_ms": cold_usage["ttft_ms"],
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    backend.close()
    n = len(rows)
    summary = {
        "method": pipeline.engine.method.name, "budget": a.budget,
        "kept_as": "cache" if pipeline.engine.method.keeps_later_turns else "held prompt",
        "equal": sum(r["equal"] for r in rows), "kept_correct": sum(r["kept_correct"] for r in rows),
        "cold_correct": sum(r["cold_correct"] for r in rows), "of": n,
        "ttft_ratio_median": round(statistics.median(r["kept_ttft_ms"] / r["cold_ttft_ms"] for r in rows), 4),
        "kept_ttft_ms_median": round(statistics.median(r["kept_ttft_ms"] for r in rows), 1),
        "cold_ttft_ms_median": round(statistics.median(r["cold_ttft_ms"] for r in rows), 1),
    }  # fmt: skip
    print(json.dumps(summary))
    out = {"command": "benchmarks/kept_vs_cold.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items() if v),
           "summary": summary, "rows": rows}  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
