"""``ov-kvcrush bench --concurrency N``: many requests over one fixed KV pool, native and ours.

The serving question: with ``--kv-pool-mib`` of KV cache, how many tokens per second does a
machine generate for ``N`` requests that arrive together? A compressed cache holds more sequences
in the same pool, so more of them decode in each step.

Per configuration (a backend × method × budget, each in its own spawned process so that its
peak RSS is its own):

* native: ``openvino_genai.ContinuousBatchingPipeline`` with ``num_kv_blocks`` sized to the pool
  (its block bytes are read from a probe pipeline first: u8 keys/values with their scales on
  CPU), its own eviction from the method's native scheduler config;
* ours: :class:`~ov_kvcrush.serving.ContinuousBatchingPipeline` with ``max_kv_blocks`` sized to
  the same pool (f16 blocks of the op).

Both get the same ``N`` fresh passkey prompts of ``--lengths`` tokens, all added at once, and are
stepped to the end by the same loop; after a warm-up request (compilation and pool allocation are
not timed). Reported: generated tokens/s over the whole run (``throughput_tps``), TTFT (from the
common start: queueing included) and per-request TPOT, p50 and p90, peak RSS, the most requests
left unscheduled in one step (``waiting_peak``: both backends prefill one prompt at a time, so it
counts that queue too), ours' preemptions and requests the pool made wait, and passkeys answered.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ov_kvcrush.bench import measure
from ov_kvcrush.bench.plan import MIN_LENGTH, BenchConfig, BenchPlan, compression, plan_configs, plan_context
from ov_kvcrush.config import GenerationSettings, to_native_scheduler_config
from ov_kvcrush.engines.genai import encode_prompt
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.eval.tasks import passkey_prompt
from ov_kvcrush.op.kvcache import block_bytes, pool_blocks
from ov_kvcrush.serving.backends import backend_info, resolve_model
from ov_kvcrush.serving.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from ov_kvcrush.validation import check_int

# Imported where used, inside functions: what pulls in matplotlib, openvino, openvino_genai, torch,
# heavy to import, so that importing this module stays light.

SERVING_BACKENDS = ("genai", "openvino")


@dataclass(frozen=True)
class ServingPlan:
    """What a serving run measures (see the module doc)."""

    backends: tuple[str, ...] = SERVING_BACKENDS
    methods: tuple[str, ...] = ("full", "kvcrush", "snapkv")
    budgets: tuple[int, ...] = (1024,)
    concurrency: int = 16
    length: int = 4096
    new_tokens: int = 64
    kv_pool_mib: float = 0.0
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    seed: int = 0
    model: str | None = None


def checked_configs(plan: ServingPlan) -> list[BenchConfig]:
    """The plan's configurations (native full first), every field checked; nothing is loaded."""
    bad = [b for b in plan.backends if b not in SERVING_BACKENDS]
    if bad:
        raise ConfigError("backends", ",".join(bad), "genai, openvino (--concurrency serves the OpenVINO backends)")
    check_int("concurrency", plan.concurrency, 1, 4096)
    check_int("new_tokens", plan.new_tokens, 2, 1 << 16)
    check_int("max_num_batched_tokens", plan.max_num_batched_tokens, 16, 1 << 20)
    if isinstance(plan.kv_pool_mib, bool) or not isinstance(plan.kv_pool_mib, (int, float)) or plan.kv_pool_mib <= 0:
        raise ConfigError("kv_pool_mib", plan.kv_pool_mib, "a positive number of MiB (the KV pool every backend gets)")

    context = plan_context(BenchPlan(model=plan.model))
    top = (context - plan.new_tokens) if context else 1 << 20
    check_int("lengths", plan.length, MIN_LENGTH, top)
    return plan_configs(plan.backends, plan.methods, plan.budgets, anchor="genai")


def serve_config(cfg: BenchConfig, plan: ServingPlan, model_dir: str, prompts: list[str]) -> dict[str, Any]:
    """One configuration's run (in a worker process): build, warm up, serve every prompt, measure."""
    if backend_info(cfg.backend).native:
        server = _NativeServer(cfg, plan, model_dir)
    else:
        server = _OurServer(cfg, plan, model_dir)
    server.warm_up()
    engine_rss = measure.RssSampler.rss()
    with measure.RssSampler() as rss:
        row = server.serve(prompts)
    row.update(peak_rss_bytes=int(rss.peak), engine_rss_bytes=int(engine_rss))
    return row


class _Loop:
    """The timed loop both backends share: add every request, step to the end, stamp each token."""

    def serve(self, prompts: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        handles = [self.add(i, p) for i, p in enumerate(prompts)]
        stamps: list[list[float]] = [[] for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        waiting_peak = steps = 0
        while self.busy():
            self.step()
            steps += 1
            now = time.perf_counter() - t0
            waiting_peak = max(waiting_peak, self.unscheduled())
            for i, h in enumerate(handles):
                new = self.read(h)
                if new:
                    tokens[i] += new
                    stamps[i] += [now] * len(new)
        wall = time.perf_counter() - t0
        texts = [self.detokenize(t) for t in tokens]
        return {
            "wall_s": wall,
            "steps": steps,
            "generated_tokens": sum(len(t) for t in tokens),
            "ttft_ms": [s[0] * 1e3 if s else None for s in stamps],
            "tpot_ms": [(s[-1] - s[0]) / (len(s) - 1) * 1e3 if len(s) > 1 else None for s in stamps],
            "texts": texts,
            "waiting_peak": waiting_peak,
            **self.extra(),
        }


class _NativeServer(_Loop):
    def __init__(self, cfg: BenchConfig, plan: ServingPlan, model_dir: str) -> None:
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        self.comp = compression(cfg)
        self.plan = plan
        probe_blocks = 8
        probe = ov_genai.ContinuousBatchingPipeline(model_dir, self._sc(probe_blocks), "CPU")
        self._run_one(probe, [1, 2, 3, 4], 2)  # the pool is allocated on the first step
        self.block_bytes = probe.get_metrics().cache_size_in_bytes // probe_blocks
        del probe

        self.blocks = pool_blocks(int(plan.kv_pool_mib * 2**20), self.block_bytes)
        self.pipe = ov_genai.ContinuousBatchingPipeline(model_dir, self._sc(self.blocks), "CPU")
        self.tokenizer = self.pipe.get_tokenizer()

    def _sc(self, blocks: int) -> Any:
        """The native scheduler config of the method, over a pool of ``blocks`` native blocks."""

        sc = to_native_scheduler_config(
            self.comp, "CPU", num_kv_blocks=blocks, max_num_batched_tokens=self.plan.max_num_batched_tokens
        )
        sc.enable_prefix_caching = False  # every prompt is fresh anyway
        return sc

    def _config(self, new_tokens: int) -> Any:
        gc = self.ov_genai.GenerationConfig()
        gc.max_new_tokens = new_tokens
        gc.ignore_eos = True
        gc.apply_chat_template = False
        return gc

    def _run_one(self, pipe: Any, ids: list[int], new_tokens: int) -> None:
        import openvino as ov

        pipe.add_request(10**6, ov.Tensor(np.asarray([ids], dtype=np.int64)), self._config(new_tokens))
        while pipe.has_non_finished_requests():
            pipe.step()

    def warm_up(self) -> None:
        self._run_one(self.pipe, list(range(100, 164)), 4)

    def add(self, i: int, prompt: str) -> Any:
        import openvino as ov

        ids = encode_prompt(self.tokenizer, prompt)
        ids_tensor = ov.Tensor(np.asarray([ids], dtype=np.int64))
        return self.pipe.add_request(i, ids_tensor, self._config(self.plan.new_tokens))

    def busy(self) -> bool:
        return self.pipe.has_non_finished_requests()

    def step(self) -> None:
        self.pipe.step()

    def unscheduled(self) -> int:
        m = self.pipe.get_metrics()
        return int(m.requests - m.scheduled_requests)

    def read(self, handle: Any) -> list[int]:
        if not handle.can_read():
            return []
        return [int(t) for out in handle.read().values() for t in out.generated_ids]

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if tokens else ""

    def extra(self) -> dict[str, Any]:
        return {"kv_pool_bytes": self.blocks * self.block_bytes, "kv_block_bytes": self.block_bytes}


class _OurServer(_Loop):
    def __init__(self, cfg: BenchConfig, plan: ServingPlan, model_dir: str) -> None:
        import openvino_genai as ov_genai

        from ov_kvcrush.serving import ContinuousBatchingPipeline  # its engine: torch (a lazy name)
        from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

        sc = ov_genai.SchedulerConfig()
        sc.max_num_batched_tokens = plan.max_num_batched_tokens
        engine = OpenVINOEngine(model_dir, compression(cfg))
        s = engine.shape

        self.block_bytes = block_bytes(engine.block_size, s.head_dim, engine.kv_precision)
        engine.max_kv_blocks = pool_blocks(int(plan.kv_pool_mib * 2**20), self.block_bytes)
        engine.set_compression(engine.compression)  # the pool, with its limit
        self.pipe = ContinuousBatchingPipeline(engine, sc)
        self.settings = GenerationSettings(max_new_tokens=plan.new_tokens, ignore_eos=True)
        self.warm = GenerationSettings(max_new_tokens=4, ignore_eos=True, apply_chat_template=False)

    def warm_up(self) -> None:
        h = self.pipe.add_request(10**6, list(range(100, 164)), self.warm)
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        h.result()

    def add(self, i: int, prompt: str) -> Any:
        return self.pipe.add_request(i, prompt, self.settings)

    def busy(self) -> bool:
        return self.pipe.has_non_finished_requests()

    def step(self) -> None:
        self.pipe.step()

    def unscheduled(self) -> int:
        return len(self.pipe.scheduler.waiting)

    def read(self, handle: Any) -> list[int]:
        return handle.read()

    def detokenize(self, tokens: list[int]) -> str:
        return self.pipe.engine.tokenizer.decode(tokens) if tokens else ""

    def extra(self) -> dict[str, Any]:
        e = self.pipe.engine
        return {
            "kv_pool_bytes": e.max_kv_blocks * self.block_bytes,
            "kv_block_bytes": self.block_bytes * e.shape.layers * e.shape.kv_heads,  # per 32 tokens, as native's
            "preemptions": self.pipe.stats["preemptions"],
            "waited_for_pool": self.pipe.stats["waited"],
            "failed": self.pipe.stats["failed"],
        }


def run_serving(plan: ServingPlan, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every configuration, one after another, each in its own process; the JSON document."""

    configs = checked_configs(plan)
    say = progress or (lambda line: None)
    model_dir = str(resolve_model("openvino", plan.model))
    import openvino_genai as ov_genai

    tokenizer = ov_genai.Tokenizer(model_dir)

    def count(text: str) -> int:
        return len(encode_prompt(tokenizer, text))

    samples = [
        passkey_prompt(plan.length, count, seed=plan.seed + 7919 * i + plan.length) for i in range(plan.concurrency)
    ]
    prompts = [s.prompt for s in samples]
    rows = []
    t_start = time.time()
    for i, cfg in enumerate(configs):
        say(f"serving {plan.concurrency} x {plan.length} tokens with {cfg.label} ({i + 1}/{len(configs)})")
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            try:
                raw = pool.submit(serve_config, cfg, plan, model_dir, prompts).result()
            except BrokenProcessPool:
                raise UserError(f"bench: the worker process serving {cfg.label!r} died") from None
        row = summarize_run(cfg, raw, samples)
        rows.append(row)
        say(
            f"  {row['throughput_tps']:7.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:8.0f} ms  TPOT p50 "
            f"{row['tpot_p50_ms']:6.1f} ms  passkeys {row['answered']}/{row['requests']}  "
            f"RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    anchor = rows[0]["throughput_tps"] or 1.0
    for row in rows:
        row["throughput_vs_native_full"] = row["throughput_tps"] / anchor
    return {
        **measure.describe_run(),
        "kind": "serving",
        "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(plan).items()},
        "anchor": "genai full",
        "wall_s": round(time.time() - t_start, 1),
        "results": rows,
    }


def summarize_run(cfg: BenchConfig, raw: dict[str, Any], samples: Sequence[Any]) -> dict[str, Any]:
    """A configuration's row: throughput, percentiles, passkeys (the raw per-request lists stay in it)."""
    ttft = [x for x in raw["ttft_ms"] if x is not None]
    tpot = [x for x in raw["tpot_ms"] if x is not None]
    answered = sum(bool(s.score(t)) for s, t in zip(samples, raw["texts"], strict=True))
    return {
        "label": cfg.label,
        "backend": cfg.backend,
        "method": cfg.method,
        "budget": cfg.budget,
        "options": dict(cfg.options),
        "requests": len(samples),
        "throughput_tps": raw["generated_tokens"] / raw["wall_s"],
        "ttft_p50_ms": statistics.median(ttft) if ttft else 0.0,
        "ttft_p90_ms": measure.percentile(ttft, 90) if ttft else 0.0,
        "tpot_p50_ms": statistics.median(tpot) if tpot else 0.0,
        "tpot_p90_ms": measure.percentile(tpot, 90) if tpot else 0.0,
        "answered": answered,
        **{k: v for k, v in raw.items() if k not in ("texts",)},
    }


def format_serving(doc: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    plan = doc["plan"]
    head = (
        f"{plan['concurrency']} requests x {plan['length']} tokens + {plan['new_tokens']} new, "
        f"KV pool {plan['kv_pool_mib']} MiB each backend\n\n"
        "| configuration | tok/s | vs native full | TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) | waiting peak | "
        "preempted | pool-waited | passkeys | peak RSS (MiB) |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in doc["results"]:
        lines.append(
            f"| {r['label']} | {r['throughput_tps']:.1f} | {r['throughput_vs_native_full']:.2f}x | "
            f"{r['ttft_p50_ms'] / 1e3:.1f} / {r['ttft_p90_ms'] / 1e3:.1f} | {r['tpot_p50_ms']:.1f} / "
            f"{r['tpot_p90_ms']:.1f} | {r['waiting_peak']} | {r.get('preemptions', '-')} | "
            f"{r.get('waited_for_pool', '-')} | {r['answered']}/{r['requests']} | {r['peak_rss_bytes'] / 2**20:.0f} |"
        )
    return "\n".join(lines)


def plot_serving(doc: dict[str, Any], path: Any) -> None:
    """Throughput and TTFT p50 per configuration (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2.5))
    colors = ["tab:gray" if backend_info(r["backend"]).native else "tab:blue" for r in rows]
    axes[0].barh(labels, [r["throughput_tps"] for r in rows], color=colors)
    axes[0].set_xlabel("generated tokens/s (higher is better)")
    axes[1].barh(labels, [r["ttft_p50_ms"] / 1e3 for r in rows], color=colors)
    axes[1].set_xlabel("TTFT p50, s (queueing included; lower is better)")
    for ax in axes:
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    plan = doc["plan"]
    fig.suptitle(
        f"{plan['concurrency']} requests x {plan['length']} tokens, {plan['new_tokens']} new, "
        f"{plan['kv_pool_mib']} MiB KV pool (gray: native openvino_genai, blue: ours)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
