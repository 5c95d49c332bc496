"""Fake engines for the benchmark harness's tests (``test_bench.py``): known timings and bytes,
so every number the harness reports has an exact expected value.

A module of their own, importing nothing heavy: the harness runs an isolated configuration in a
spawned worker process, which unpickles the engine factory by name and so imports the module
that defines it; here that costs the worker 0.1 s, against 1.3 s for the test module's imports.
"""

from __future__ import annotations

import os
import re
import statistics

from ov_kvcrush.bench import BenchConfig
from ov_kvcrush.engines.base import GenerationResult
from ov_kvcrush.errors import ConfigError


class FakeEngine:
    """Answers the passkey with known timings: TTFT = length / 10 ms, steps of `step` ms."""

    def __init__(self, cfg: BenchConfig, step: float, kv_per_token: int, log: list):
        self.cfg, self.step, self.kv, self.log = cfg, step, kv_per_token, log
        self.model_dir = "/nonexistent"

    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def generate(self, prompt: str, settings) -> GenerationResult:
        n = len(self.encode(prompt))
        self.log.append((self.cfg.label, n))
        key = re.search(r"pass key is (\d+)", prompt).group(1)
        steps = [self.step] * (settings.max_new_tokens - 1)
        steps[-1] = 5 * self.step  # one slow step: median and p90 differ from the mean
        held = n if self.cfg.budget is None else min(n, self.cfg.budget)
        return GenerationResult(
            text=f"The pass key is {key}.",
            token_ids=list(range(settings.max_new_tokens)),
            prompt_tokens=n,
            ttft_ms=n / 10,
            tpot_ms=statistics.mean(steps),
            kv_bytes=held * self.kv,
            full_kv_bytes=n * self.kv,
            peak_kv_bytes=n * self.kv,
            method=self.cfg.method,
            budget=self.cfg.budget,
            backend=self.cfg.backend,
            counters={"policy_decode_ms": 1.0, "policy_prefill_ms": 2.0} if self.cfg.backend == "openvino" else {},
            step_ms=steps,
        )


#: bytes each fake configuration keeps allocated from its first run on (a KV cache stand-in)
HELD = {"openvino snapkv @256": 96 << 20}


class HoldingEngine(FakeEngine):
    """A fake engine that keeps ``HELD[label]`` bytes resident after generating."""

    def generate(self, prompt: str, settings) -> GenerationResult:
        self.held = b"\x01" * HELD.get(self.cfg.label, 0)  # written, so resident
        return super().generate(prompt, settings)


def holding_engine(cfg: BenchConfig) -> HoldingEngine:
    """Module level: the worker processes unpickle it by name."""
    return HoldingEngine(cfg, 1.0, 10, [])


class CrashingEngine(FakeEngine):
    def generate(self, prompt: str, settings) -> GenerationResult:
        if self.cfg.method == "snapkv":
            os._exit(7)  # what a native abort looks like from outside
        return super().generate(prompt, settings)


def crashing_engine(cfg: BenchConfig) -> CrashingEngine:
    return CrashingEngine(cfg, 1.0, 10, [])


def refusing_engine(cfg: BenchConfig) -> FakeEngine:
    if cfg.backend == "openvino":
        raise ConfigError("kv_precision", "f8", "f16 or f32")
    return FakeEngine(cfg, 1.0, 10, [])
