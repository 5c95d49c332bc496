"""A streaming terminal chat on the embedded model (``ov-kvcrush chat``, ``samples/chat.py``).

Each line you type is a user turn; the answer streams as it is generated. The ``openvino``
backend (default) keeps the KV cache across turns and feeds only the new tokens. Commands:
``/reset`` starts a new conversation, ``/stats`` prints the cache the conversation holds,
``/exit`` (or end of input) quits. Piped input works too::

    printf 'Hi, I am Ada.\\nWhat is my name?\\n' | ov-kvcrush chat --max-new-tokens 40
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ov_kvcrush.config import GenerationSettings, parse_method_budget
from ov_kvcrush.errors import UserError
from ov_kvcrush.pipeline import LLMPipeline


def methods_help() -> str:
    """The ``--method`` help: the methods each backend runs, from the registry (shown with ``--help``)."""
    from ov_kvcrush.methods import methods_by_engine

    return "compression method, by backend: " + methods_by_engine()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chat's flags (shared by ``ov-kvcrush chat`` and ``samples/chat.py``)."""
    p.add_argument("--backend", default="openvino", help="openvino (default: cache kept across turns), genai, torch")
    p.add_argument("--method", default="full").help_from = methods_help
    p.add_argument("--budget", type=int, help="KV tokens kept per layer and KV head (required unless full)")
    p.add_argument("--model", help="model for the backend (default: the embedded SmolLM2-135M)")
    p.add_argument("--system", default="", help="system message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--kv-precision", default=None, help="backend openvino: f16 (default) or f32")
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.7, top-p 0.9) instead of greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no per-turn timing line")


def chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """Run the chat loop until ``/exit`` or end of input."""
    options = {}
    if args.kv_precision is not None:
        if args.backend != "openvino":
            raise UserError(f"--kv-precision is for --backend openvino, got --backend={args.backend}")
        options["kv_precision"] = args.kv_precision
    compression = parse_method_budget(args.method, args.budget)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=0.7 if args.sample else 1.0,
        top_p=0.9 if args.sample else 1.0,
        seed=args.seed,
    )
    pipe = LLMPipeline(args.model, "CPU", backend=args.backend, compression=compression, **options)
    interactive = stdin.isatty()
    pipe.start_chat(args.system)
    last = None

    def stream(piece: str) -> bool:
        stdout.write(piece)
        stdout.flush()
        return False

    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            pipe.finish_chat()
            pipe.start_chat(args.system)
            stdout.write("(new conversation)\n")
            continue
        if text == "/stats":
            stdout.write(_stats(pipe, last) + "\n")
            continue
        last = pipe.generate(text, settings, streamer=stream)
        stdout.write("\n")
        if not args.quiet:
            print(
                f"[{last.prompt_tokens} tokens in context, {last.counters.get('prefill_tokens', last.prompt_tokens)} "
                f"prefilled; TTFT {last.ttft_ms:.0f} ms, TPOT {last.tpot_ms:.1f} ms]",
                file=sys.stderr,
            )
    pipe.finish_chat()
    return 0


def _stats(pipe: LLMPipeline, last) -> str:
    engine = pipe.engine
    seq = getattr(engine, "sequence", None)
    if seq is not None:
        st = seq.stats()
        return f"cache: {st.tokens_seen} tokens, {st.blocks_held} blocks, {st.kv_bytes / 2**20:.2f} MiB"
    if last is None:
        return "cache: empty"
    return f"last turn: KV {last.kv_bytes / 2**20:.2f} MiB (backend {pipe.backend} re-reads the whole conversation)"
