"""Where a configuration's engine runs: in this process (:class:`LocalRunner`) or in its own
spawned worker process (:class:`Worker`), so that its peak RSS is its own; a dying worker is an
error naming the configuration."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from ov_kvcrush.bench import measure
from ov_kvcrush.bench.plan import BenchConfig, compression
from ov_kvcrush.errors import UserError
from ov_kvcrush.serving.backends import backend_info, make_engine


def build_engine(cfg: BenchConfig, model: str | Path, device: str) -> Any:
    """The engine a configuration runs, on an already resolved model."""
    # the OpenVINO backends name their device as OpenVINO does
    return make_engine(cfg.backend, model, compression(cfg), device=backend_info(cfg.backend).device_name(device),
                       **cfg.engine_options)  # fmt: skip


class LocalRunner:
    """A configuration's engine in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.engine_rss = measure.RssSampler.rss()
        self.weight_bytes = measure.weight_bytes(engine)

    def count(self, text: str) -> int:
        return len(self.engine.encode(text))

    def generate(self, prompt: str, settings: Any) -> tuple[Any, int]:
        with measure.RssSampler() as rss:
            r = self.engine.generate(prompt, settings)
        return r, rss.peak

    def generate_batch(self, prompts: list[str], settings: Any) -> tuple[list[Any], int]:
        with measure.RssSampler() as rss:
            rows = self.engine.generate_batch(prompts, settings)
        return rows, rss.peak

    def close(self) -> None:
        self.engine = None


class WorkerError(UserError):
    """A configuration's worker process failed: its engine raised, or the process died."""


def serve(conn: Any, cfg: BenchConfig, model: str | Path | None, device: str, factory: Any) -> None:
    """A worker process: build one configuration's engine, then count tokens and generate on request."""

    def failure(exc: BaseException) -> tuple[str, tuple[bool, str]]:
        return "error", (isinstance(exc, UserError), f"{type(exc).__name__}: {exc}")

    try:
        local = LocalRunner(factory(cfg) if factory is not None else build_engine(cfg, model, device))
        conn.send(("ok", (local.engine_rss, local.weight_bytes)))
    except BaseException as exc:  # the parent reports it, naming the configuration
        conn.send(failure(exc))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg[0] == "stop":
            return
        try:
            if msg[0] == "count":
                conn.send(("ok", local.count(msg[1])))
            else:
                work = local.generate_batch if msg[0] == "generate_batch" else local.generate
                conn.send(("ok", work(msg[1], msg[2])))
        except Exception as exc:
            conn.send(failure(exc))


class Worker:
    """A configuration's engine in its own process (spawned, so no thread pool is forked)."""

    def __init__(self, cfg: BenchConfig, model: str | Path | None, device: str, factory: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.label = cfg.label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, cfg, model, device, factory), daemon=True)
        self.proc.start()
        child.close()
        try:
            self.engine_rss, self.weight_bytes = self._reply()
        except BaseException:
            self.close()  # the engine failed to build: nothing to keep alive
            raise

    def _reply(self) -> Any:
        try:
            kind, payload = self.conn.recv()
        except (EOFError, ConnectionError):
            self.proc.join(10)
            raise WorkerError(
                f"bench: the worker process running {self.label!r} died (exit code {self.proc.exitcode})"
            ) from None
        if kind == "error":
            user, text = payload
            raise WorkerError(f"bench: {self.label!r} failed: {text}" if not user else f"{self.label}: {text}")
        return payload

    def _ask(self, *msg: Any) -> Any:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionError):
            pass  # the reply reports the dead process
        return self._reply()

    def count(self, text: str) -> int:
        return self._ask("count", text)

    def generate(self, prompt: str, settings: Any) -> tuple[Any, int]:
        return self._ask("generate", prompt, settings)

    def generate_batch(self, prompts: list[str], settings: Any) -> tuple[list[Any], int]:
        return self._ask("generate_batch", prompts, settings)

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()
