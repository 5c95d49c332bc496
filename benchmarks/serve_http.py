"""The server against the in-process pipeline (issue 50's targets), on this machine:

1. throughput: 16 concurrent chat requests of ~1k tokens and 256 new tokens (``ignore_eos``),
   a 70 MiB KV pool, SnapKV @512 and the full cache: the server (the official ``openai`` client,
   16 streams at once over loopback) against the same pipeline's ``generate`` in process,
   alternated for ``--rounds`` rounds (the ratio of their sums), and passkeys answered;
2. the second turn of a ~3k-token conversation (the full cache, whose conversations the server
   keeps): its TTFT continued from the kept cache against the same request with no kept cache
   (median of 3);
3. RSS of the server's process over 500 short requests after 50 of warm-up.

    .venv/bin/python benchmarks/serve_http.py --json docs/results/serving/serve_http_cpu.json

writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

from ov_kvcrush.bench import measure
from ov_kvcrush.cli.main import build_parser
from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.eval.tasks import passkey_prompt
from ov_kvcrush.server.app import make_app
from ov_kvcrush.server.config import ServerConfig
from ov_kvcrush.server.factory import build_backend
from ov_kvcrush.server.thread import ServerThread


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def token_counter(loop: Any):
    return lambda text: len(loop.encode(text, False))


def make_backend(method: str, budget: int | None, pool_mib: float, model: str | None) -> Any:
    argv = ["serve", "--method", method, "--kv-pool-mib", str(pool_mib), "--max-queue", "256"]
    argv += ["--budget", str(budget)] if budget else []
    argv += ["--model", model] if model else []
    return build_backend(ServerConfig.from_args(build_parser().parse_args(argv)))


async def stream_all(url: str, model: str, conversations: list[list[dict[str, str]]], max_tokens: int):
    """Every conversation as one streamed request, all at once; (texts, completion tokens, wall s)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)

    async def one(messages: list[dict[str, str]]) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, tokens = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    t0 = time.perf_counter()
    async with client:  # closed in this event loop (a round's loop ends with it)
        done = await asyncio.gather(*(one(m) for m in conversations))
    return [t for t, _ in done], sum(n for _, n in done), time.perf_counter() - t0


def ratio(r: dict[str, Any]) -> float:
    """A round's server throughput over its in-process one."""
    return r["server_generated"] * r["in_process_s"] / (r["in_process_generated"] * r["server_s"])


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per method, ``--rounds`` rounds, each the in-process ``generate`` then the server on the
    same pool and requests: time on this machine drifts by several percent between minutes, so
    the ratio is of the rounds' sums, with each round's beside it."""
    rows = []
    for method, budget in (("snapkv", 512), ("full", None)):
        backend = make_backend(method, budget, args.pool_mib, args.model)
        loop = backend.pipeline
        count = token_counter(loop)
        samples = [passkey_prompt(args.tokens, count, seed=7919 * i + args.tokens) for i in range(args.requests)]
        conversations = [[{"role": "user", "content": s.prompt}] for s in samples]
        settings = GenerationSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
        loop.generate([conversations[0]], GenerationSettings(max_new_tokens=4))  # warm-up
        rounds = []
        with ServerThread(make_app(backend)) as server:
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                results = loop.generate(conversations, settings)
                wall_in = time.perf_counter() - t0
                texts, tokens_http, wall_http = asyncio.run(
                    stream_all(server.url, backend.model_name, conversations, args.new_tokens)
                )
                loop.kept.clear()  # the server kept each conversation: the next round starts as this one
                rounds.append({"in_process_s": wall_in, "server_s": wall_http,
                               "in_process_generated": sum(r.generated_tokens for r in results),
                               "server_generated": tokens_http})  # fmt: skip
        row = {
            "method": method,
            "budget": budget,
            "in_process_tps": sum(r["in_process_generated"] for r in rounds) / sum(r["in_process_s"] for r in rounds),
            "server_tps": sum(r["server_generated"] for r in rounds) / sum(r["server_s"] for r in rounds),
            "rounds": rounds,
            "round_ratios": [ratio(r) for r in rounds],
            "in_process_generated": rounds[-1]["in_process_generated"],
            "server_generated": rounds[-1]["server_generated"],
            "passkeys_in_process": sum(bool(s.score(r.text)) for s, r in zip(samples, results, strict=True)),
            "passkeys_server": sum(bool(s.score(t)) for s, t in zip(samples, texts, strict=True)),
            "same_texts": sum(t == r.text for t, r in zip(texts, results, strict=True)),
            "requests": len(samples),
        }
        row["server_vs_in_process"] = row["server_tps"] / row["in_process_tps"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows[0]["server_vs_full_server"] = rows[0]["server_tps"] / rows[1]["server_tps"]
    return rows


async def first_token_ms(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]]) -> tuple[float, str]:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                  stream=True)  # fmt: skip
    first, text = None, ""
    async for chunk in stream:
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece and first is None:
            first = (time.perf_counter() - t0) * 1e3
        text += piece or ""
    return first or 0.0, text


def second_turn(args: argparse.Namespace) -> dict[str, Any]:
    # the full cache: the method whose conversations the server keeps (MethodConfig.keeps_later_turns)
    backend = make_backend("full", None, args.pool_mib, args.model)
    loop = backend.pipeline
    count = token_counter(loop)
    kept_ms, fresh_ms, answers = [], [], []

    async def turns(url: str) -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        for rep in range(3):
            sample = passkey_prompt(3000, count, seed=100 + rep)
            first = [{"role": "user", "content": sample.prompt}]
            a1 = (await first_token_ms(client, backend.model_name, first))[1]
            second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "Repeat it."}]
            ms, a2 = await first_token_ms(client, backend.model_name, second)
            kept_ms.append(ms)
            answers.append(bool(sample.score(a2)))
            loop.kept.clear()  # the same second turn with no kept cache
            fresh_ms.append((await first_token_ms(client, backend.model_name, second))[0])
            loop.kept.clear()

    with ServerThread(make_app(backend)) as server:
        asyncio.run(turns(server.url))
    row = {
        "conversation_tokens": 3000,
        "ttft_kept_ms": statistics.median(kept_ms),
        "ttft_fresh_ms": statistics.median(fresh_ms),
        "ttft_kept_runs_ms": kept_ms,
        "ttft_fresh_runs_ms": fresh_ms,
        "second_turn_answered": sum(answers),
        "turns": len(answers),
    }
    row["ratio"] = row["ttft_kept_ms"] / row["ttft_fresh_ms"]
    print(json.dumps(row), flush=True)
    return row


def rss_growth(args: argparse.Namespace) -> dict[str, Any]:
    backend = make_backend("snapkv", 512, args.pool_mib, args.model)
    samples = []
    with ServerThread(make_app(backend)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for i in range(args.rss_requests + 50):
            client.chat.completions.create(model=backend.model_name, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": f"Number {i}?"}])  # fmt: skip
            if i >= 49 and (i - 49) % 50 == 0:
                samples.append(rss_bytes())
    row = {"requests_after_warmup": args.rss_requests, "rss_bytes": samples,
           "growth_bytes": samples[-1] - samples[0]}  # fmt: skip
    print(json.dumps({k: v for k, v in row.items() if k != "rss_bytes"}), flush=True)
    return row


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rows = doc["throughput"]
    labels = [f"{r['method']}" + (f" @{r['budget']}" if r["budget"] else "") for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["in_process_tps"] for r in rows], 0.4, label="in process")
    a.bar([i + 0.2 for i in x], [r["server_tps"] for r in rows], 0.4, label="server (HTTP, openai client)")
    a.set_xticks(list(x), labels)
    a.set_ylabel("generated tokens/s")
    a.set_title(f"{rows[0]['requests']} concurrent chats, ~1k tokens + 256 new")
    a.legend(loc="lower center")
    t = doc["second_turn"]
    b.bar(["kept cache", "no kept cache"], [t["ttft_kept_ms"], t["ttft_fresh_ms"]])
    b.set_ylabel("second turn TTFT (ms)")
    b.set_title(f"second turn of a {t['conversation_tokens']}-token conversation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--pool-mib", type=float, default=70.0)
    p.add_argument("--rounds", type=int, default=3, help="in-process and server runs alternated, per method")
    p.add_argument("--rss-requests", type=int, default=500)
    args = p.parse_args()
    doc = {**measure.describe_run(), "kind": "serve_http", "args": vars(args)}
    doc["command"] = " ".join([".venv/bin/python", "benchmarks/serve_http.py", *sys.argv[1:]])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for part, run in (("throughput", throughput), ("second_turn", second_turn), ("rss", rss_growth)):
        doc[part] = run(args)
        tmp = out.with_suffix(".tmp")  # written after each part, whole, then renamed
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)
    plot(doc, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
