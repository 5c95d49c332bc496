"""Running a plan: load every configuration (each in its worker), measure the bandwidth, time the
runs in the scheduled order on fresh prompts, and assemble the JSON document."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from ov_kvcrush.bench import measure
from ov_kvcrush.bench.plan import (
    BenchConfig,
    BenchPlan,
    anchor_backend,
    checked_plan,
    device_of,
    speed_only,
)
from ov_kvcrush.bench.report import summarize
from ov_kvcrush.bench.worker import LocalRunner, Worker, build_engine
from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.errors import UserError
from ov_kvcrush.eval.tasks import passkey_prompt
from ov_kvcrush.serving.backends import resolve_model

# Imported where used, inside functions: what pulls in torch, heavy to import, so that importing
# this module stays light.


def run_bench(
    plan: BenchPlan,
    *,
    progress: Callable[[str], None] | None = None,
    engine_factory: Callable[[BenchConfig], Any] | None = None,
) -> dict[str, Any]:
    """Run the plan; return the JSON document (``results``, ``runs``, ``bandwidth_gbps``, ...).

    ``engine_factory`` replaces the real engines (tests); with ``plan.isolate`` it must be picklable
    (a module-level function), since it runs in the worker processes.
    """
    configs, order = checked_plan(plan)  # every check before anything loads
    devices = {device_of(c, plan) for c in configs}
    say = progress or (lambda line: None)
    models: dict[str, Any] = {}
    if engine_factory is None:  # export/convert once, here, before the workers share the cache
        # the transformers baselines run the torch engine's model (a checkpoint)
        models = {c.backend: resolve_model(c.backend, plan.model) for c in configs}
    runners: dict[str, Any] = {}
    t_start = time.time()
    try:
        for i, c in enumerate(configs):
            say(f"loading {c.label} ({i + 1}/{len(configs)})")
            if plan.isolate:
                runners[c.label] = Worker(c, models.get(c.backend), device_of(c, plan), engine_factory)
            else:
                engine = engine_factory(c) if engine_factory else build_engine(c, models[c.backend], device_of(c, plan))
                runners[c.label] = LocalRunner(engine)
        bandwidths = {"cpu": measure.measure_bandwidth_gbps()}  # the floor of every CPU backend, and the anchor's
        bandwidths.update({d: measure.measure_bandwidth_gbps(device=d) for d in sorted(devices - {"cpu"})})
        warm_up(plan, configs, runners, say)
        runs = timed_runs(plan, order, runners, runners[configs[0].label], say)
    finally:
        for runner in runners.values():
            runner.close()
    weights = {c.backend: runners[c.label].weight_bytes for c in configs}
    info = measure.describe_run()
    gpus = sorted(d for d in devices if d != "cpu")
    if gpus:  # the results name the device they were measured on
        import torch

        info["machine"]["gpus"] = {d: torch.cuda.get_device_name(torch.device(d)) for d in gpus}
    return {
        **info,
        "bandwidth_gbps": bandwidths["cpu"],
        "device_bandwidth_gbps": bandwidths,
        "prefix_caching": "off in the genai engine, and every run has a fresh prompt",
        "anchor": f"{anchor_backend(plan)} full",
        "speed_only": speed_only(plan),
        "isolation": "one worker process per configuration: peak_rss_bytes is that process's"
        if plan.isolate
        else "one process holds every configuration: peak_rss_bytes is the whole process's",
        "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(plan).items()},
        "weight_bytes": weights,
        "wall_s": round(time.time() - t_start, 1),
        "results": summarize(runs, weights, bandwidths, anchor=anchor_backend(plan)),
        "runs": runs,
    }


#: the warm-up's prompt and new tokens (a GPU configuration's first call compiles its kernels)
WARM_UP_TOKENS, WARM_UP_NEW = 512, 4


def warm_up(
    plan: BenchPlan, configs: Sequence[BenchConfig], runners: dict[str, Any], say: Callable[[str], None]
) -> None:
    """One short untimed generation per configuration on a GPU (of the plan's batch): Triton
    compiles a kernel at its first call (measured on an H200: ClusterKV's first 8k TTFT 1693 ms,
    the next 283 ms), which must not land in a timed repeat. The CPU backends compile when they load."""

    settings = GenerationSettings(max_new_tokens=WARM_UP_NEW, ignore_eos=True)
    for c in configs:
        if device_of(c, plan) != "cpu":
            say(f"warming up {c.label}")
            runner = runners[c.label]
            prompts = batch_prompts(WARM_UP_TOKENS, plan.batch, runner.count, seed=plan.seed + 1)
            generate(runner, [p.prompt for p in prompts], settings)


def batch_prompts(length: int, rows: int, count: Callable[[str], int], seed: int) -> list[Any]:
    """``rows`` passkey prompts of ``length`` tokens at most, with different keys, of one token
    count (a batch is never padded): the first from ``seed``, the others from the next seeds
    whose prompt counts as many tokens."""

    first = passkey_prompt(length, count, seed=seed)
    out, tokens = [first], count(first.prompt)
    for s in range(seed + 1, seed + 1 + 64 * rows):
        if len(out) == rows:
            return out
        sample = passkey_prompt(length, count, seed=s)
        if count(sample.prompt) == tokens:
            out.append(sample)
    if len(out) < rows:
        raise UserError(f"bench: no {rows} passkey prompts of {tokens} tokens (one batch) in {64 * rows} seeds")
    return out


def generate(runner: Any, prompts: list[str], settings: Any) -> tuple[list[Any], int]:
    """One run: the results of ``prompts`` (one, or a batch) and the process's peak RSS."""
    if len(prompts) == 1:
        r, peak = runner.generate(prompts[0], settings)
        return [r], peak
    return runner.generate_batch(prompts, settings)


def timed_runs(
    plan: BenchPlan,
    order: Sequence[tuple[int, int, BenchConfig]],
    runners: dict[str, Any],
    counter: Any,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The runs in ``order``: fresh passkey prompts per repeat and length (one, or a batch),
    every configuration."""

    settings = GenerationSettings(max_new_tokens=plan.new_tokens, ignore_eos=True)
    quality = not speed_only(plan)  # random weights: the passkey answer means nothing
    samples: dict[tuple[int, int], Any] = {}
    runs = []
    for i, (rep, length, c) in enumerate(order):
        if (rep, length) not in samples:
            samples[rep, length] = batch_prompts(length, plan.batch, counter.count, plan.seed + 1000 * rep + length)
        batch = samples[rep, length]
        t0 = time.perf_counter()
        rows, peak_rss = generate(runners[c.label], [s.prompt for s in batch], settings)
        wall_ms = (time.perf_counter() - t0) * 1e3
        r = rows[0]  # the rows of a batch share its prefill and its steps
        steps = list(getattr(r, "step_ms", []) or [])
        decode_ms = r.tpot_ms * max(len(r.token_ids) - 1, 1)
        counters = r.counters or {}
        kv_bytes = sum(int(x.kv_bytes) for x in rows)
        run = {
            "label": c.label,
            "backend": c.backend,
            "method": c.method,
            "budget": c.budget,
            "options": dict(c.options),
            "engine_options": dict(c.engine_options),
            "length": length,
            "repeat": rep,
            "batch": len(rows),
            "prompt_tokens": r.prompt_tokens,
            "ttft_ms": r.ttft_ms,
            "tpot_ms": statistics.median(steps) if steps else r.tpot_ms,
            "tpot_mean_ms": r.tpot_ms,
            "tpot_p90_ms": measure.percentile(steps, 90) if steps else r.tpot_ms,
            "kv_bytes": kv_bytes,
            "kv_read_bytes": int(counters.get("kv_read_bytes", kv_bytes)),
            "peak_rss_bytes": int(peak_rss),
            "engine_rss_bytes": int(runners[c.label].engine_rss),
            "device": device_of(c, plan),
            "correct": sum(bool(s.score(x.text)) for s, x in zip(batch, rows, strict=True)) if quality else None,
            "clustering_prefill_share": counters["clustering_prefill_ms"] / r.ttft_ms
            if "clustering_prefill_ms" in counters and r.ttft_ms
            else None,
            "policy_decode_share": counters["policy_decode_ms"] / decode_ms if "policy_decode_ms" in counters else None,
            "policy_prefill_share": counters["policy_prefill_ms"] / r.ttft_ms
            if "policy_prefill_ms" in counters and r.ttft_ms
            else None,
            "wall_ms": wall_ms,
        }
        runs.append(run)
        say(
            f"[{i + 1}/{len(order)}] rep {rep} {length:6d} tok  {c.label:32s} TTFT {r.ttft_ms:8.0f} ms  "
            f"TPOT {run['tpot_ms']:6.1f} ms  KV {run['kv_bytes'] / 2**20:8.2f} MiB  "
            f"RSS {peak_rss / 2**20:6.0f} MiB"
        )
    return runs
