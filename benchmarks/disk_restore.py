"""A conversation's second turn after the server was killed, continued from ``--cache-dir``,
against the same history sent cold (issue 73's targets: TTFT at most 0.1x a cold prefill's, the
same answer, files at most 1.2x the cache's ``kv_bytes``).

Each conversation is a needle document (``niah_single``) in turn one ("Reply with OK."). A server
started as users start it (``ov-kvcrush serve --cache-dir DIR``) answers every turn one, then is
killed with SIGKILL; a second server on the same directory answers every question turn; a third,
without a cache directory, answers the same histories cold. Writes a JSON of the answers, their
TTFTs (as the client sees them: from the request sent to its first streamed text, so the file's
read is counted; the loop's own, from the request queued, beside them), the cached prompt tokens
and each file's size against its cache's bytes::

    .venv/bin/python benchmarks/disk_restore.py --length 3000 --conversations 5 \\
        --json docs/results/serving/disk_restore_full.json
    .venv/bin/python benchmarks/disk_restore.py ... --kv-precision f32 --json ..._full_f32.json
    .venv/bin/python benchmarks/disk_restore.py ... --method snapkv --budget 256 --json ..._snapkv_256.json

A compressing method's file is a held prompt (turn one's prompt before the method's selection,
ov_kvcrush/serving/kept.py): the files are weighed against the kept caches' bytes, read from
``GET /pool`` once the first server is idle (what it holds then is its kept caches).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from ov_kvcrush.eval import tasks as T
from ov_kvcrush.models.export import ensure_default_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``ov-kvcrush serve`` in a process of its own, killed with SIGKILL when done."""

    def __init__(self, extra: list[str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "ov_kvcrush", "serve", "--port", str(self.port), "--served-model-name", "m",
               "--quiet", *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if not self.proc.stdout.readline().startswith("serving "):
            raise SystemExit("the server did not start")
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-", max_retries=0)

    def ask(self, messages: list[dict], max_tokens: int = 24) -> tuple[str, dict]:
        """The answer, streamed, and its usage; ``ttft_ms`` as the client sees it (from the request
        sent to its first text: the file read and the tokenizer included), ``loop_ttft_ms`` the
        loop's own (from the request queued, after its cache was restored)."""
        t0 = time.perf_counter()
        stream = self.client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})  # fmt: skip
        text, first, u = "", None, None
        for chunk in stream:
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece and first is None:
                first = (time.perf_counter() - t0) * 1e3
            text += piece or ""
            u = chunk.usage or u
        assert u is not None and first is not None, "the stream had no text or no usage"
        return text, {
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.prompt_tokens_details.cached_tokens,
            "ttft_ms": round(first, 3), "loop_ttft_ms": u.model_extra["ttft_ms"], "kv_bytes": u.model_extra["kv_bytes"],
        }  # fmt: skip

    def pool(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/pool") as r:
            return json.loads(r.read())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=3000, help="the document's tokens")
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--kv-precision", default="u8", help="the servers' --kv-precision (default u8, as native)")
    p.add_argument("--method", default="full", help="the servers' --method (default: the full cache)")
    p.add_argument("--budget", type=int, default=None, help="the servers' --budget, for a method that takes one")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    budget = ["--budget", str(a.budget)] if a.budget else []
    precision = ["--kv-precision", a.kv_precision, "--method", a.method, *budget]
    from ov_kvcrush.serving.backends import make_engine

    count = make_engine("openvino", ensure_default_model(progress=False), None, "CPU").count_tokens
    task = T.GENERATION_TASKS["niah_single"]
    samples = [task(a.length, count, 0, i, a.conversations) for i in range(a.conversations)]
    with tempfile.TemporaryDirectory(prefix="ovkc-disk-") as tmp:  # the caches go with it
        cache_dir = Path(tmp)
        firsts, seconds = [], []
        server = Server(["--cache-dir", str(cache_dir), *precision])
        try:
            for s in samples:
                document = s.prompt[: -len(s.question)]
                turn = [{"role": "user", "content": document + "\n\nRead the text above. Reply with OK."}]
                answer, usage = server.ask(turn)
                firsts.append(usage)
                reply = {"role": "assistant", "content": answer}
                seconds.append([*turn, reply, {"role": "user", "content": s.question}])
            kept = server.pool()
        finally:
            server.kill()  # kill -9: only what is on disk survives
        files = sorted((f.stat().st_size for f in cache_dir.rglob("*.kvc.npz")), reverse=True)
        rows = []
        restarted = Server(["--cache-dir", str(cache_dir), *precision])
        try:
            from_disk = [restarted.ask(m) for m in seconds]
        finally:
            restarted.kill()
    cold_server = Server(precision)
    try:
        cold = [cold_server.ask(m) for m in seconds]
    finally:
        cold_server.kill()
    for i, s in enumerate(samples):
        (d_text, d), (c_text, c) = from_disk[i], cold[i]
        rows.append({
            "conversation": i, "answer": s.answers[0], "from_disk": d_text, "cold": c_text, "equal": d_text == c_text,
            "prompt_tokens": d["prompt_tokens"], "cached_tokens": d["cached_tokens"],
            "ttft_disk_ms": d["ttft_ms"], "ttft_cold_ms": c["ttft_ms"], "ttft_ratio": d["ttft_ms"] / c["ttft_ms"],
            "loop_ttft_disk_ms": d["loop_ttft_ms"], "loop_ttft_cold_ms": c["loop_ttft_ms"],
            "turn1_kv_bytes": firsts[i]["kv_bytes"],
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    kv = sorted((f["kv_bytes"] for f in firsts), reverse=True)
    summary = {
        "equal": sum(r["equal"] for r in rows), "of": len(rows),
        "disk_correct": sum(r["answer"] in r["from_disk"] for r in rows),
        "cold_correct": sum(r["answer"] in r["cold"] for r in rows),
        "ttft_ratio_max": max(r["ttft_ratio"] for r in rows),
        "ttft_ratio_mean": sum(r["ttft_ratio"] for r in rows) / len(rows),
        "file_bytes": files, "answer_kv_bytes": kv, "kept": kept["kept"], "kept_kv_bytes": kept["kv_bytes"],
        "files_over_kept_kv_bytes": sum(files) / kept["kv_bytes"],
    }  # fmt: skip
    print(json.dumps(summary))
    command = f"benchmarks/disk_restore.py --length {a.length} --conversations {a.conversations}"
    method = f" --method {a.method}" + (f" --budget {a.budget}" if a.budget else "")
    out = {"command": f"{command} --kv-precision {a.kv_precision}{method}",
           "summary": summary, "rows": rows}  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
