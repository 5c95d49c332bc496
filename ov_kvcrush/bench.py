"""``ov-kvcrush bench``: speed and memory of every backend x method x budget x context length.

One run measures every configuration on the same machine, in an interleaved order (repeat ``r``
runs the configurations forward when ``r`` is even, backward when odd, each length in turn), so
that machine noise hits every configuration alike and the ratios between them are meaningful.
Every run gets a fresh prompt (passkey prompts with a per-run seed): native ``openvino_genai``
caches prefixes on CPU by default, and a repeated prompt would time the cache, not the prefill
(our ``genai`` engine also turns prefix caching off).

Reported per configuration and length (medians over the repeats): TTFT, TPOT (median and p90 of
the decode steps), decode tokens/s, peak process RSS during the run, KV bytes held at the end, the
share of prefill/decode time the method's own work took (measured inside our op), and:

* ratios to native ``openvino_genai`` with the full cache at the same length;
* the **bandwidth floor**: a decode step must at least read every weight and every KV byte once,
  so ``floor_ms = (weight_bytes + kv_bytes) / bandwidth``, with the bandwidth measured in the same
  run (a large array copy, bytes read + written); ``tpot_vs_floor`` is TPOT / floor.

Each configuration runs in its own worker process (``BenchPlan.isolate``, on by default), so
its peak RSS is its own: the engine, its compiled model and its KV cache, not every other
configuration's engines too. The parent only builds prompts and keeps time order; a worker that
dies (a crash inside native code) is reported as an error naming the configuration.

The JSON keeps every run too (``runs``), the machine, the package versions and the command.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ov_kvcrush.errors import ConfigError, UserError

#: backends the harness runs (``genai``: native openvino_genai, the anchor)
BENCH_BACKENDS = ("genai", "openvino", "torch")
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
#: keys every entry of ``results`` carries (the JSON schema's required part; more keys are added)
RESULT_KEYS = ("backend", "method", "budget", "length", "ttft_ms", "tpot_ms", "kv_bytes", "peak_rss_bytes")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: a backend running a method at a budget (``None`` for the full cache)."""

    backend: str
    method: str
    budget: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        tail = "" if self.budget is None else f" @{self.budget}"
        opts = "".join(f" {k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.backend} {self.method}{opts}{tail}"


def backend_methods(backend: str) -> tuple[str, ...]:
    """The methods ``backend`` runs (``full`` included)."""
    from ov_kvcrush.methods import methods_for

    if backend not in BENCH_BACKENDS:
        raise ConfigError("backend", backend, "one of " + ", ".join(BENCH_BACKENDS))
    return methods_for(backend)


def check_config(cfg: BenchConfig) -> None:
    """Refuse a configuration the backend cannot run, naming the field and what is allowed."""
    from ov_kvcrush.config import to_native_scheduler_config

    allowed = backend_methods(cfg.backend)
    if cfg.method not in allowed:
        raise ConfigError("method", cfg.method, f"one of {', '.join(allowed)} (backend {cfg.backend})")
    if cfg.method == "full":
        if cfg.budget is not None:
            raise ConfigError("budget", cfg.budget, "none for method full")
        if cfg.options:
            raise ConfigError("options", cfg.options, "none for method full")
        return
    if cfg.budget is None or cfg.budget < 1:
        raise ConfigError("budget", cfg.budget, f"a positive token count for method {cfg.method}")
    comp = compression(cfg)  # the method checks its own options and ranges
    if cfg.backend == "genai":  # native constraints (block multiples ...)
        to_native_scheduler_config(comp, "CPU")


def compression(cfg: BenchConfig) -> Any:
    """The :class:`~ov_kvcrush.config.CompressionConfig` a configuration runs."""
    from ov_kvcrush.config import CompressionConfig, parse_method_budget

    if cfg.method == "full":
        return CompressionConfig()
    return parse_method_budget(cfg.method, cfg.budget, options=dict(cfg.options))


def parse_method(item: str) -> tuple[str, dict[str, Any]]:
    """A ``--methods`` item: a method name, optionally with method options after colons
    (``kvcrush:block_size=32``, ``snapkv:quant=true``; values as in ``--option``)."""
    from ov_kvcrush.config import parse_options

    name, *opts = item.split(":")
    if not name.strip():
        raise ConfigError("methods", item, "a method name, optionally followed by :KEY=VALUE options")
    return name.strip(), parse_options(opts, flag=f"--methods {name.strip()}:")


def plan_configs(
    backends: Sequence[str], methods: Sequence[str], budgets: Sequence[int], *, anchors: bool = True
) -> list[BenchConfig]:
    """Every backend x method x budget, where the backend has the method, plus (``anchors``) native
    full cache, the configuration every ratio divides by.

    ``methods`` items may carry options (see :func:`parse_method`). A method a listed backend
    does not have, or options it does not take, are left out for that backend (ClusterKV, or
    KVCrush's ``block_size``, on the native backend); but a method or options no listed backend
    takes, an unknown backend, or a budget a backend refuses for a method it has is an error
    naming the field. ``full`` runs once per backend.
    """
    for b in backends:
        backend_methods(b)
    configs: list[BenchConfig] = [BenchConfig("genai", "full")] if anchors else []
    for item in methods:
        m, options = parse_method(item)
        where = [b for b in backends if m in backend_methods(b)]
        if not where:
            check_config(BenchConfig(backends[0], m, None if m == "full" else budgets[0]))  # raises, naming it
        per_budget: Sequence[int | None] = [None] if m == "full" else budgets
        if options:  # options are the backend's: kept where they are accepted, an error nowhere
            refused = []
            for b in list(where):
                try:
                    check_config(BenchConfig(b, m, per_budget[0], options))
                except UserError as exc:
                    refused.append(exc)
                    where.remove(b)
            if not where:
                raise refused[0]
        for b in where:
            for c in [BenchConfig(b, m, x, options) for x in per_budget]:
                check_config(c)
                if c not in configs:
                    configs.append(c)
    return configs


def schedule(
    configs: Sequence[BenchConfig], lengths: Sequence[int], repeats: int
) -> list[tuple[int, int, BenchConfig]]:
    """The order of the runs: ``(repeat, length, config)``; forward on even repeats, backward on odd."""
    if repeats < 1:
        raise ConfigError("repeats", repeats, "an integer >= 1")
    order = []
    for r in range(repeats):
        for n in lengths:
            for c in configs if r % 2 == 0 else list(reversed(configs)):
                order.append((r, n, c))
    return order


def measure_bandwidth_gbps(mib: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """The memory bandwidth of ``device``: the best of ``repeats`` copies of a ``mib`` MiB array,
    counting the bytes read and the bytes written (GB/s, 1e9 bytes). ``cuda[:N]`` measures that
    GPU's memory (the floor of the torch engine running there)."""
    if device.lower().startswith("cuda"):
        import torch

        src = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats + 1):  # the first copy warms the allocator and the driver up
            torch.cuda.synchronize(src.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(src.device)
            best = min(best, time.perf_counter() - t0)
        return 2 * src.numel() * 4 / best / 1e9
    import numpy as np

    src = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def floor_ms(weight_bytes: int, kv_bytes: int, bandwidth_gbps: float) -> float:
    """The least time a decode step can take: read every weight and every KV byte once."""
    if bandwidth_gbps <= 0:
        raise ConfigError("bandwidth_gbps", bandwidth_gbps, "a positive number")
    return (weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9) * 1e3


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RssSampler:
    """Peak resident memory of this process while a run lasts (sampled every ``period`` s)."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: the process's peak so far
            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def summarize(
    runs: Iterable[dict[str, Any]], weight_bytes: dict[str, int], bandwidth_gbps: float | dict[str, float]
) -> list[dict[str, Any]]:
    """One result per (configuration, length): medians over the repeats, and the ratios.

    ``weight_bytes`` maps a backend to the bytes of weights one decode step reads;
    ``bandwidth_gbps`` is the CPU's, or a mapping from device (a run's ``device``, default
    ``cpu``) to its bandwidth.
    """
    bandwidths = bandwidth_gbps if isinstance(bandwidth_gbps, dict) else {"cpu": bandwidth_gbps}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["label"], run["length"]), []).append(run)
    results = []
    for (label, length), mine in groups.items():
        first = mine[0]
        tpot = statistics.median(r["tpot_ms"] for r in mine)
        kv = statistics.median(r["kv_bytes"] for r in mine)
        row = {
            "label": label,
            "backend": first["backend"],
            "method": first["method"],
            "budget": first["budget"],
            "options": first["options"],
            "length": length,
            "prompt_tokens": first["prompt_tokens"],
            "runs": len(mine),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in mine),
            "tpot_ms": tpot,
            "tpot_p90_ms": statistics.median(r["tpot_p90_ms"] for r in mine),
            "decode_tokens_per_s": 1e3 / tpot if tpot else 0.0,
            "kv_bytes": int(kv),
            "peak_rss_bytes": int(max(r["peak_rss_bytes"] for r in mine)),
            "engine_rss_bytes": first.get("engine_rss_bytes"),
            "device": first.get("device", "cpu"),
            "correct": sum(bool(r["correct"]) for r in mine),
        }
        for key in ("policy_decode_share", "policy_prefill_share"):
            vals = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        row["floor_ms"] = floor_ms(weight_bytes[first["backend"]], row["kv_bytes"], bandwidths[row["device"]])
        row["tpot_vs_floor"] = tpot / row["floor_ms"] if row["floor_ms"] else None
        results.append(row)
    anchors = {r["length"]: r for r in results if r["backend"] == "genai" and r["method"] == "full"}
    for r in results:
        base = anchors.get(r["length"])
        r["tpot_vs_native_full"] = r["tpot_ms"] / base["tpot_ms"] if base and base["tpot_ms"] else None
        r["kv_vs_native_full"] = r["kv_bytes"] / base["kv_bytes"] if base and base["kv_bytes"] else None
    return results


def validate_doc(doc: dict[str, Any]) -> None:
    """Check a bench JSON document's schema (the keys and types other tools may rely on)."""
    for key, kind in (("results", list), ("bandwidth_gbps", (int, float)), ("machine", dict), ("runs", list)):
        if not isinstance(doc.get(key), kind):
            raise ValueError(f"bench JSON: {key!r} missing or not a {getattr(kind, '__name__', kind)}")
    for i, r in enumerate(doc["results"]):
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            raise ValueError(f"bench JSON: results[{i}] lacks {', '.join(missing)}")
        for k in ("length", "kv_bytes", "peak_rss_bytes"):
            if not isinstance(r[k], int) or r[k] < 0:
                raise ValueError(f"bench JSON: results[{i}].{k} must be a non-negative integer")
        for k in ("ttft_ms", "tpot_ms"):
            if not isinstance(r[k], (int, float)) or r[k] < 0:
                raise ValueError(f"bench JSON: results[{i}].{k} must be a non-negative number")
        if r["budget"] is not None and not isinstance(r["budget"], int):
            raise ValueError(f"bench JSON: results[{i}].budget must be an integer or null")


@dataclass
class BenchPlan:
    """What ``ov-kvcrush bench`` runs (see the module docstring).

    ``methods`` items may carry options (``kvcrush:block_size=32``). ``device`` is where the torch
    backend runs (``cpu``, ``cuda``, ``cuda:N``); the OpenVINO backends run on the CPU. ``isolate``
    runs every configuration in its own worker process (its peak RSS is its own); without it, one
    process holds every engine and the RSS column is that process's.
    """

    backends: tuple[str, ...] = ("genai", "openvino")
    methods: tuple[str, ...] = ("full", "kvcrush", "snapkv")
    budgets: tuple[int, ...] = (1024,)
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    repeats: int = 2
    new_tokens: int = 32
    seed: int = 0
    model: str | None = None
    device: str = "cpu"
    isolate: bool = True


def device_of(cfg: BenchConfig, plan: BenchPlan) -> str:
    """Where a configuration runs: the plan's device for the torch backend, else the CPU."""
    return plan.device.lower() if cfg.backend == "torch" else "cpu"


def build_engine(cfg: BenchConfig, model: str | Path, device: str) -> Any:
    """The engine a configuration runs, on an already resolved model."""
    from ov_kvcrush.engines import make_engine

    # the OpenVINO backends name their device as OpenVINO does
    return make_engine(cfg.backend, model, compression(cfg), device=device if cfg.backend == "torch" else "CPU")


class _Local:
    """A configuration's engine in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.engine_rss = RssSampler.rss()
        self.weight_bytes = weight_bytes(engine)

    def count(self, text: str) -> int:
        return len(self.engine.encode(text))

    def generate(self, prompt: str, settings: Any) -> tuple[Any, int]:
        with RssSampler() as rss:
            r = self.engine.generate(prompt, settings)
        return r, rss.peak

    def close(self) -> None:
        self.engine = None


class WorkerError(UserError):
    """A configuration's worker process failed: its engine raised, or the process died."""


def _serve(conn: Any, cfg: BenchConfig, model: str | Path | None, device: str, factory: Any) -> None:
    """A worker process: build one configuration's engine, then count tokens and generate on request."""

    def failure(exc: BaseException) -> tuple[str, tuple[bool, str]]:
        return "error", (isinstance(exc, UserError), f"{type(exc).__name__}: {exc}")

    try:
        local = _Local(factory(cfg) if factory is not None else build_engine(cfg, model, device))
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
            conn.send(("ok", local.count(msg[1]) if msg[0] == "count" else local.generate(msg[1], msg[2])))
        except Exception as exc:
            conn.send(failure(exc))


class _Worker:
    """A configuration's engine in its own process (spawned, so no thread pool is forked)."""

    def __init__(self, cfg: BenchConfig, model: str | Path | None, device: str, factory: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.label = cfg.label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, cfg, model, device, factory), daemon=True)
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
    configs, order = _checked(plan)  # every check before anything loads
    devices = {device_of(c, plan) for c in configs}
    if engine_factory is None and "torch" in plan.backends:
        from ov_kvcrush.engines.torch_engine import resolve_device

        resolve_device(plan.device)  # a bad or missing device is refused before any model loads
    say = progress or (lambda line: None)
    models: dict[str, Any] = {}
    if engine_factory is None:  # export/convert once, here, before the workers share the cache
        from ov_kvcrush.engines import resolve_model

        models = {c.backend: resolve_model(c.backend, plan.model) for c in configs}
    runners: dict[str, Any] = {}
    t_start = time.time()
    try:
        for i, c in enumerate(configs):
            say(f"loading {c.label} ({i + 1}/{len(configs)})")
            if plan.isolate:
                runners[c.label] = _Worker(c, models.get(c.backend), device_of(c, plan), engine_factory)
            else:
                engine = engine_factory(c) if engine_factory else build_engine(c, models[c.backend], device_of(c, plan))
                runners[c.label] = _Local(engine)
        bandwidths = {"cpu": measure_bandwidth_gbps()}  # the floor of every CPU backend, and the anchor's
        bandwidths.update({d: measure_bandwidth_gbps(device=d) for d in sorted(devices - {"cpu"})})
        runs = _timed_runs(plan, order, runners, runners[configs[0].label], say)
    finally:
        for runner in runners.values():
            runner.close()
    weights = {c.backend: runners[c.label].weight_bytes for c in configs}
    info = describe_run()
    gpus = sorted(d for d in devices if d != "cpu")
    if gpus:  # the results name the device they were measured on
        import torch

        info["machine"]["gpus"] = {d: torch.cuda.get_device_name(torch.device(d)) for d in gpus}
    return {
        **info,
        "bandwidth_gbps": bandwidths["cpu"],
        "device_bandwidth_gbps": bandwidths,
        "prefix_caching": "off in the genai engine, and every run has a fresh prompt",
        "isolation": "one worker process per configuration: peak_rss_bytes is that process's"
        if plan.isolate
        else "one process holds every configuration: peak_rss_bytes is the whole process's",
        "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(plan).items()},
        "weight_bytes": weights,
        "wall_s": round(time.time() - t_start, 1),
        "results": summarize(runs, weights, bandwidths),
        "runs": runs,
    }


def _checked(plan: BenchPlan) -> tuple[list[BenchConfig], list[tuple[int, int, BenchConfig]]]:
    """The plan's configurations and run order, every field checked; nothing is loaded."""
    configs = plan_configs(plan.backends, plan.methods, plan.budgets)
    order = schedule(configs, plan.lengths, plan.repeats)
    if plan.new_tokens < 2:
        raise ConfigError("new_tokens", plan.new_tokens, "an integer >= 2 (TPOT needs two tokens)")
    for n in plan.lengths:
        if not isinstance(n, int) or n < 64:
            raise ConfigError("lengths", n, "prompt lengths of at least 64 tokens")
    return configs, order


def dry_run(plan: BenchPlan) -> str:
    """What :func:`run_bench` would run, checked as it would be (configurations, lengths, runs),
    without loading a model: a committed benchmark command can be checked in a test."""
    configs, order = _checked(plan)
    head = f"{len(configs)} configurations x {len(plan.lengths)} lengths x {plan.repeats} repeats"
    lines = [f"{head} = {len(order)} runs", *(f"  {c.label}" for c in configs)]
    lines.append("lengths: " + ", ".join(str(n) for n in plan.lengths))
    return "\n".join(lines)


def _timed_runs(
    plan: BenchPlan,
    order: Sequence[tuple[int, int, BenchConfig]],
    runners: dict[str, Any],
    counter: Any,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The runs in ``order``: one fresh passkey prompt per repeat and length, every configuration."""
    from ov_kvcrush.config import GenerationSettings
    from ov_kvcrush.eval.tasks import passkey_prompt

    settings = GenerationSettings(max_new_tokens=plan.new_tokens, ignore_eos=True)
    samples: dict[tuple[int, int], Any] = {}
    runs = []
    for i, (rep, length, c) in enumerate(order):
        if (rep, length) not in samples:
            samples[rep, length] = passkey_prompt(length, counter.count, seed=plan.seed + 1000 * rep + length)
        sample = samples[rep, length]
        t0 = time.perf_counter()
        r, peak_rss = runners[c.label].generate(sample.prompt, settings)
        wall_ms = (time.perf_counter() - t0) * 1e3
        steps = list(getattr(r, "step_ms", []) or [])
        decode_ms = r.tpot_ms * max(len(r.token_ids) - 1, 1)
        counters = r.counters or {}
        run = {
            "label": c.label,
            "backend": c.backend,
            "method": c.method,
            "budget": c.budget,
            "options": dict(c.options),
            "length": length,
            "repeat": rep,
            "prompt_tokens": r.prompt_tokens,
            "ttft_ms": r.ttft_ms,
            "tpot_ms": statistics.median(steps) if steps else r.tpot_ms,
            "tpot_mean_ms": r.tpot_ms,
            "tpot_p90_ms": percentile(steps, 90) if steps else r.tpot_ms,
            "kv_bytes": int(r.kv_bytes),
            "peak_rss_bytes": int(peak_rss),
            "engine_rss_bytes": int(runners[c.label].engine_rss),
            "device": device_of(c, plan),
            "correct": bool(sample.score(r.text)),
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


def weight_bytes(engine: Any) -> int:
    """Bytes of weights a decode step reads: the torch model's parameters, else the IR's (or
    GGUF's) weight file(s) as stored (int8 weights count one byte each)."""
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "parameters"):
        return int(sum(p.numel() * p.element_size() for p in model.parameters()))
    d = Path(getattr(engine, "model_dir", ""))
    if d.is_file():
        return d.stat().st_size
    return int(sum(f.stat().st_size for f in d.glob("openvino_model*.bin")))


def plot(doc: dict[str, Any], out: str | Path) -> None:
    """TPOT vs length and KV bytes vs length, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    labels = list(dict.fromkeys(r["label"] for r in doc["results"]))
    # one colour per method and options (the same across backends), one line style per backend
    kinds = list(dict.fromkeys(label.split(" ", 1)[1] for label in labels))
    colours = plt.get_cmap("tab20" if len(kinds) > 10 else "tab10")
    styles = {"genai": "--", "openvino": "-", "torch": ":"}
    for label in labels:
        rows = sorted((r for r in doc["results"] if r["label"] == label), key=lambda r: r["length"])
        xs = [r["length"] for r in rows]
        kw = {"color": colours(kinds.index(label.split(" ", 1)[1])), "marker": "o", "label": label}
        a.plot(xs, [r["tpot_ms"] for r in rows], styles.get(rows[0]["backend"], "-"), **kw)
        b.plot(xs, [r["kv_bytes"] / 2**20 for r in rows], styles.get(rows[0]["backend"], "-"), **kw)
    a.set(xlabel="context length (tokens)", ylabel="TPOT (ms, median)", title="decode time per token")
    b.set(xlabel="context length (tokens)", ylabel="KV cache held (MiB)", title="KV memory", yscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
    b.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"ov-kvcrush bench ({doc['machine']['cpu']}, {doc['bandwidth_gbps']:.1f} GB/s copy bandwidth)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def format_table(doc: dict[str, Any]) -> str:
    """The results as a text table (one line per configuration and length).

    ``xTPOT``/``xKV``: ratios to native full cache at that length; ``xfloor``: TPOT over the
    bandwidth floor; ``pre%``/``dec%``: the method's own share of prefill/decode time (selection,
    clustering, merging, quantising; measured inside our op and the torch cache); ``RSS``: peak
    resident memory of the configuration's process during its runs."""
    head = (
        f"{'configuration':38s} {'tokens':>6s} {'TTFT ms':>8s} {'TPOT ms':>8s} {'p90':>6s} {'tok/s':>6s} "
        f"{'KV MiB':>8s} {'xTPOT':>6s} {'xKV':>6s} {'xfloor':>6s} {'pre%':>5s} {'dec%':>5s} {'RSS MiB':>8s}"
    )
    lines = [head]

    def ratio(x: float | None, digits: int = 2) -> str:
        return f"{x:6.{digits}f}" if x is not None else f"{'':6s}"

    def share(x: float | None) -> str:
        return f"{100 * x:5.1f}" if x is not None else f"{'':5s}"

    for r in doc["results"]:
        lines.append(
            f"{r['label']:38s} {r['length']:6d} {r['ttft_ms']:8.0f} {r['tpot_ms']:8.1f} {r['tpot_p90_ms']:6.1f} "
            f"{r['decode_tokens_per_s']:6.1f} {r['kv_bytes'] / 2**20:8.2f} {ratio(r['tpot_vs_native_full'])} "
            f"{ratio(r['kv_vs_native_full'], 3)} {ratio(r['tpot_vs_floor'])} "
            f"{share(r.get('policy_prefill_share'))} {share(r.get('policy_decode_share'))} "
            f"{r['peak_rss_bytes'] / 2**20:8.0f}"
        )
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown table, for the committed results page."""

    def x(v: float | None, digits: int = 2) -> str:
        return "" if v is None else f"{v:.{digits}f}×"

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:.1f} %"

    lines = [
        "| configuration | tokens | TTFT ms | TPOT ms (median) | p90 | tok/s | KV MiB | TPOT vs native full "
        "| KV vs native full | TPOT vs floor | method share of prefill | of decode | peak RSS MiB | passkey |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['label']} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.1f} | {r['tpot_p90_ms']:.1f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['kv_bytes'] / 2**20:.2f} | {x(r['tpot_vs_native_full'])} "
            f"| {x(r['kv_vs_native_full'], 3)} | {x(r['tpot_vs_floor'])} | {pct(r.get('policy_prefill_share'))} "
            f"| {pct(r.get('policy_decode_share'))} | {r['peak_rss_bytes'] / 2**20:.0f} | {r['correct']}/{r['runs']} |"
        )
    return "\n".join(lines)


def describe_run() -> dict[str, Any]:
    """The command, the machine and the package versions of this run."""
    from ov_kvcrush.eval.runner import package_versions

    return {
        "command": " ".join(["ov-kvcrush", *sys.argv[1:]]) if sys.argv else "",
        "machine": {
            "cpu": _cpu_name(),
            "arch": platform.machine(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "python": sys.version.split()[0],
            "system": platform.platform(),
        },
        "versions": package_versions(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
