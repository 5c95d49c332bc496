"""A streaming terminal chat on the embedded model (``ov-kvcrush chat``, ``samples/chat.py``).

Each line you type is a user turn; the answer streams as it is generated. The ``openvino``
backend (default) keeps the KV cache across turns and feeds only the new tokens. Commands:
``/help`` lists them, ``/reset`` starts a new conversation, ``/stats`` prints the cache the
conversation holds, ``/save FILE`` writes the conversation and its cache to a file and ``/load
FILE`` continues one (after a restart too), ``/exit`` (or end of input) quits; ``//text`` sends
``/text``. Ctrl-C stops
an answer and keeps the chat; a turn past the model's context drops the oldest turns first.
Piped input works too::

    printf 'Hi, I am Ada.\\nWhat is my name?\\n' | ov-kvcrush chat --max-new-tokens 40
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TextIO

from ov_kvcrush.config import GenerationSettings, parse_method_budget
from ov_kvcrush.errors import UserError
from ov_kvcrush.pipeline import LLMPipeline
from ov_kvcrush.serving.backends import engine_options
from ov_kvcrush.serving.chat import CHAT_METHOD, chat_method

# Imported where used, inside functions: what pulls in prompt_toolkit, torch, heavy to import, so
# that importing this module stays light.


def methods_help() -> str:
    """The ``--method`` help: the methods each backend runs, from the registry (shown with ``--help``)."""
    from ov_kvcrush.methods import methods_by_engine

    return "compression method, by backend: " + methods_by_engine()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chat's flags (shared by ``ov-kvcrush chat`` and ``samples/chat.py``)."""
    p.add_argument("--backend", default="openvino", help="openvino (default: cache kept across turns), genai, torch")
    p.add_argument("--method", default=None).help_from = methods_help
    p.add_argument(
        "--budget",
        type=int,
        help=f"KV tokens kept per layer and KV head; without --method the chat compresses with {CHAT_METHOD}",
    )
    p.add_argument("--model", help="model for the backend (default: the embedded smollm2-135m; or gemma3-270m)")
    p.add_argument("--system", default="", help="system message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--kv-precision", default=None, help="backend openvino: KV u8 (default, as native), f16 or f32")
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.7, top-p 0.9) instead of greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no per-turn timing line")


def cache_policy(compression) -> str:
    """The line the chat shows about its cache: the method, its budget, and whether a later
    question can still find what a turn holds."""
    name = compression.method
    if not compression.compresses:
        return "cache: full (every token kept)"
    method = compression.method_config()
    if method.scoring_pass:
        slack = getattr(method, "slack_tokens", 0)
        after = f"once the cache is over it by more than {slack} tokens, " if slack else ""
        return (
            f"cache: {name}, budget {compression.budget} per layer and KV head; query-agnostic: {after}the turns "
            "are scored by reconstructing them, so later questions find what they held"
        )
    return (
        f"cache: {name}, budget {compression.budget} per layer and KV head; it keeps what the queries seen so far "
        f"attend, so a later question may need what it evicted ({CHAT_METHOD} scores each turn without them)"
    )


#: The chat's commands (a line starting with ``/``; ``//text`` sends ``/text`` to the model).
COMMANDS = {
    "/help": "this list",
    "/reset": "start a new conversation",
    "/stats": "the cache the conversation holds",
    "/save": "FILE: write the conversation and its cache to FILE",
    "/load": "FILE: continue the conversation saved in FILE",
    "/exit": "quit (also /quit, or end of input: Ctrl-D)",
}


def _save_or_load(pipe: LLMPipeline, command: str, path: str) -> str:
    """``/save FILE`` or ``/load FILE``: what was done, or why not (the chat goes on either way)."""
    if not path:
        return f"({command} needs a file: {command} FILE)"
    try:
        if command == "/save":
            return f"(saved the conversation to {path}: {pipe.save_chat(path) / 2**20:.1f} MiB)"
        restored = pipe.load_chat(path)
    except (UserError, OSError) as exc:
        return f"(error: {exc}; the conversation goes on)"
    turns = sum(m.get("role") == "user" for m in pipe.chat_history or [])
    how = "its cache restored" if restored else "its next turn prefills it"
    return f"(continuing the conversation of {path}: {turns} turn(s), {how})"


def chat(
    args: argparse.Namespace,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    pipe: LLMPipeline | None = None,
) -> int:
    """Run the chat loop until ``/exit`` or end of input.

    The conversation survives what would end it: a turn that does not fit the context drops the
    oldest turns first (the system message stays); Ctrl-C during an answer stops that answer, at
    the prompt it only reminds how to quit; an error in a turn is printed and the chat goes on.
    Commands never reach the model. On a terminal the line editor takes long and multi-line
    pastes whole (a terminal's own line buffer cuts lines past 4095 characters).
    """
    options = engine_options(args.backend, {"kv_precision": ("--kv-precision", args.kv_precision, None)})
    method = chat_method(args.method, args.budget)
    compression = parse_method_budget(method, args.budget)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=0.7 if args.sample else 1.0,
        top_p=0.9 if args.sample else 1.0,
        seed=args.seed,
    )
    if pipe is None:
        pipe = LLMPipeline(args.model, "CPU", backend=args.backend, compression=compression, **options)
    read = _line_reader(stdin, stdout)
    if not args.quiet:
        print(f"[{cache_policy(compression)}]", file=sys.stderr)
    pipe.start_chat(args.system)
    last = None
    while True:
        try:
            line = read()
        except KeyboardInterrupt:
            stdout.write("\n(Ctrl-D or /exit quits)\n")
            continue
        except EOFError:
            break
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                pipe.finish_chat()
                pipe.start_chat(args.system)
                stdout.write("(new conversation)\n")
            elif command == "/stats":
                stdout.write(_stats(pipe, last) + "\n")
            elif command in ("/save", "/load"):
                stdout.write(_save_or_load(pipe, command, text[len(command) :].strip()) + "\n")
            elif command == "/help":
                stdout.write("".join(f"  {c:8s} {what}\n" for c, what in COMMANDS.items()))
            else:
                stdout.write(f"(unknown command {command}: /help lists them; //text sends /text)\n")
            continue
        if text.startswith("//"):
            text = text[1:]
        try:
            dropped = pipe.fit_chat(text, settings.max_new_tokens)
            if dropped:
                stdout.write(f"(dropped the {dropped} oldest turn(s) to fit the model's context)\n")
            with _StopOnInterrupt() as stop:

                def stream(piece: str) -> bool:
                    stdout.write(piece)
                    stdout.flush()
                    return stop.requested

                last = pipe.generate(text, settings, streamer=stream)
        except UserError as exc:
            stdout.write(f"\n(error: {exc}; the conversation goes on)\n")
            continue
        stdout.write(" [stopped]\n" if stop.requested else "\n")
        if not args.quiet:
            print(
                f"[{last.prompt_tokens} tokens in context, {last.counters.get('prefill_tokens', last.prompt_tokens)} "
                f"prefilled; TTFT {last.ttft_ms:.0f} ms, TPOT {last.tpot_ms:.1f} ms]",
                file=sys.stderr,
            )
    pipe.finish_chat()
    return 0


class _StopOnInterrupt:
    """While an answer streams, Ctrl-C (SIGINT) asks it to stop at the next token instead of
    ending the program (where signals can be handled: the main thread)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._stop)
        return self

    def _stop(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _line_reader(stdin: TextIO, stdout: TextIO):
    """A function returning the next turn (``None`` at the end of input): a line editor on a
    terminal (prompt_toolkit: pastes of any length and of several lines arrive whole), else lines."""
    if stdin.isatty() and stdout.isatty():
        try:
            from prompt_toolkit import PromptSession

            session = PromptSession()
            return lambda: session.prompt("> ")
        except ImportError:  # the package depends on it; a trimmed install still chats
            pass

    def read_line() -> str | None:
        if stdin.isatty():
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        return line or None

    return read_line


def _stats(pipe: LLMPipeline, last) -> str:
    engine = pipe.engine
    seq = getattr(engine, "sequence", None)
    if seq is not None:
        st = seq.stats()
        return f"cache: {st.tokens_seen} tokens, {st.blocks_held} blocks, {st.kv_bytes / 2**20:.2f} MiB"
    if last is None:
        return "cache: empty"
    return f"last turn: KV {last.kv_bytes / 2**20:.2f} MiB (backend {pipe.backend} re-reads the whole conversation)"
