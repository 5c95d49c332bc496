"""The terminal chat survives what used to end it: commands never reach the model, Ctrl-C stops
only the answer, an error in one turn leaves the conversation, and a conversation past the
model's context drops its oldest turns (the system message stays) and goes on."""

from __future__ import annotations

import argparse
import io
import signal

import pytest

from ov_kvcrush.cli.chat import chat
from ov_kvcrush.engines.base import GenerationResult
from ov_kvcrush.errors import UserError


def args(**kw) -> argparse.Namespace:
    base = dict(
        backend="openvino",
        method="full",
        budget=None,
        model=None,
        system="",
        max_new_tokens=8,
        kv_precision=None,
        sample=False,
        seed=0,
        quiet=True,
    )
    return argparse.Namespace(**{**base, **kw})


class FakePipe:
    """What the chat loop needs of an LLMPipeline; records what reaches the model."""

    def __init__(self, interrupt_after: int | None = None, fail_on: str | None = None) -> None:
        self.sent: list[str] = []
        self.interrupt_after = interrupt_after
        self.fail_on = fail_on
        self.pieces_streamed = 0
        self.engine = object()  # no cache of its own: /stats reports the last turn
        self.backend = "fake"

    def start_chat(self, system: str = "") -> None:
        self.history = []

    def finish_chat(self) -> None:
        self.history = None

    def fit_chat(self, message: str, max_new_tokens: int) -> int:
        return 0

    def generate(self, text, settings, streamer=None):
        if text == self.fail_on:
            raise UserError("prompt (9000 tokens) + max_new_tokens (8) exceeds the model's context of 8192 tokens")
        self.sent.append(text)
        for i, piece in enumerate(["one ", "two ", "three ", "four "]):
            if self.interrupt_after is not None and i == self.interrupt_after:
                signal.raise_signal(signal.SIGINT)  # the user presses Ctrl-C while the answer streams
            self.pieces_streamed += 1
            if streamer(piece):
                break
        return GenerationResult(
            text="x",
            token_ids=[1],
            prompt_tokens=1,
            ttft_ms=1.0,
            tpot_ms=1.0,
            kv_bytes=0,
            full_kv_bytes=0,
            peak_kv_bytes=0,
            method="full",
            budget=None,
            backend="fake",
        )


def run(lines: str, pipe: FakePipe) -> str:
    out = io.StringIO()
    assert chat(args(), io.StringIO(lines), out, pipe=pipe) == 0
    return out.getvalue()


def test_commands_never_reach_the_model():
    pipe = FakePipe()
    out = run("/help\n/stats\n/nonsense\n//slash text\nhello\n/reset\n/exit\nnever sent\n", pipe)
    assert pipe.sent == ["/slash text", "hello"]
    assert "/reset" in out and "unknown command /nonsense" in out and "(new conversation)" in out


def test_ctrl_c_stops_the_answer_and_keeps_the_chat():
    before = signal.getsignal(signal.SIGINT)  # a background job's shell may have set SIG_IGN
    pipe = FakePipe(interrupt_after=2)
    out = run("first\n", pipe)
    assert pipe.pieces_streamed == 3 and "one two three  [stopped]" in out  # stopped at the next token
    pipe = FakePipe(interrupt_after=1)
    pipe_out = run("first\nsecond\n", pipe)
    assert pipe.sent == ["first", "second"] and pipe_out.count("[stopped]") == 2  # the chat went on
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back


def test_an_error_in_a_turn_leaves_the_conversation():
    pipe = FakePipe(fail_on="too long")
    out = run("too long\nnext\n", pipe)
    assert pipe.sent == ["next"]
    assert "exceeds the model's context" in out and "the conversation goes on" in out


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_a_conversation_past_the_context_drops_its_oldest_turns(model_dir, method):
    """Turns of ~70 tokens against a 300-token context: the chat keeps answering; every turn's
    prompt fits, the system message stays, and what the cache holds matches the conversation."""
    from ov_kvcrush import LLMPipeline

    budget = None if method == "full" else 160
    pipe = LLMPipeline(model_dir, backend="openvino", compression=method, budget=budget)
    pipe.engine.max_context = 300
    system = "You are a terse assistant."
    pipe.start_chat(system)
    turn = "Here is a note about the weather in the mountains today, it is quite cold and windy. " * 3
    dropped_total = 0
    for i in range(8):
        dropped_total += pipe.fit_chat(f"{i}: {turn}", 8)
        r = pipe.generate(f"{i}: {turn}", max_new_tokens=8)
        assert r.prompt_tokens + 8 <= 300
        history = pipe.chat_history
        assert history[0] == {"role": "system", "content": system}
        assert history[-2]["content"].startswith(f"{i}: ")
    assert dropped_total >= 4
    assert pipe.engine.sequence.stats().tokens_seen <= 300
    pipe.finish_chat()


@pytest.mark.slow
@pytest.mark.model
def test_a_long_paste_on_a_terminal_arrives_whole(model_dir, tmp_path):
    """On a terminal (a pseudo-terminal here) a 6,000-character paste, longer than a terminal's
    4,095-character line buffer, reaches the model whole: the cache then holds all its tokens."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    # 6,019 characters of one-token words: cut at the 4,095-character line buffer, at most 293 of them
    words = " ".join(["extraordinary"] * 430)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ov_kvcrush", "chat", "--max-new-tokens", "4", "--quiet", "--model", str(model_dir)],
        stdin=slave,
        stdout=slave,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, timeout: float = 180.0) -> None:
        """Read the terminal until ``marker``, answering the line editor's cursor-position queries."""
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen:
            assert time.monotonic() < end, seen[-500:]
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                chunk = os.read(master, 65536)
                seen += chunk
                for _ in range(chunk.count(b"\x1b[6n")):
                    os.write(master, b"\x1b[1;1R")

    try:
        read_until(b">")  # the prompt is up
        os.write(master, b"\x1b[200~Repeat the last word. " + words.encode() + b" END\x1b[201~\r")
        os.write(master, b"/stats\r")  # typed ahead: read once the answer is done
        seen = b""
        read_until(b"MiB")
        tokens = int(seen.split(b"cache: ")[1].split(b" tokens")[0])
        assert tokens > 430, seen[-300:]  # the whole paste (and the template around it)
        os.write(master, b"/exit\r")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
