"""What a bench run measures: its configurations (backend x method x budget, checked before
anything loads), the run order (interleaved repeats) and the dry run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ov_kvcrush.config import SPARSE_PREFILL, STORE_WIDTHS, CompressionConfig, MethodSpec, parse_method_budget
from ov_kvcrush.engines.base import model_context
from ov_kvcrush.engines.random_model import is_random_model, random_architecture
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.models.export import embedded_gguf_path, resolve_source
from ov_kvcrush.serving.backends import ALL
from ov_kvcrush.validation import check_choice, check_int

# Imported where used, inside functions: what pulls in torch, heavy to import, so that importing
# this module stays light.

#: backends the harness runs (``genai``: native openvino_genai, the anchor; transformers' own
#: caches as rows of their own beside the torch engine on a GPU, method ``full`` only)
BENCH_BACKENDS = tuple(ALL)
#: backends that run on the plan's ``--device`` (the OpenVINO ones run on the CPU), for messages
TORCH_BACKENDS = tuple(name for name, b in ALL.items() if b.torch_devices)


#: fit the embedded model's 8192-token context with the default 32 new tokens
DEFAULT_LENGTHS = (1024, 2048, 4096, 8000)
#: the shortest prompt the passkey task fits in (intro, key, question and the chat template)
MIN_LENGTH = 256
#: the most sequences one batched run decodes together
MAX_BATCH = 256


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: a backend running a method at a budget (``None`` for the full cache)."""

    backend: str
    method: str
    budget: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    #: the engine's own keyword options (native's ``sparse_prefill``), beside the method's
    engine_options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``backend method[ key=value ...][+store] [@budget]``: a store named as ``--methods``
        names it (``openvino kvzip+4bit @1024``)."""

        tail = "" if self.budget is None else f" @{self.budget}"
        options = dict(self.options)
        quant = options.get("quant")
        store = ""
        if isinstance(quant, dict) and set(quant) == {"key_bits", "value_bits"}:
            widths = (quant["key_bits"], quant["value_bits"])
            store = next((f"+{name}" for name, w in STORE_WIDTHS.items() if w == widths), "")
            if store:
                del options["quant"]
        opts = "".join(f" {k}={v}" for k, v in sorted({**options, **self.engine_options}.items()))
        return f"{self.backend} {self.method}{opts}{store}{tail}"


def backend_methods(backend: str) -> tuple[str, ...]:
    """The methods ``backend`` runs (``full`` included)."""
    if backend not in ALL:
        raise ConfigError("backend", backend, "one of " + ", ".join(BENCH_BACKENDS))
    return ALL[backend].methods()


def check_config(cfg: BenchConfig) -> None:
    """Refuse a configuration the backend cannot run, naming the field and what is allowed."""

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
    ALL[cfg.backend].constraints(comp)  # the backend's own (native block multiples, the op's block size)


def compression(cfg: BenchConfig) -> Any:
    """The :class:`~ov_kvcrush.config.CompressionConfig` a configuration runs."""

    if cfg.method == "full":
        return CompressionConfig()
    return parse_method_budget(cfg.method, cfg.budget, options=dict(cfg.options))


def parse_method(item: str) -> tuple[str, dict[str, Any]]:
    """A ``--methods`` item (:class:`~ov_kvcrush.config.MethodSpec`: ``kvcrush:block_size=32``,
    ``snapkv:quant=true``, ``kvzip+4bit``, ``snapkv:block_size=32+k2v4``): the method's name and
    its options, the store as ``quant``'s widths. The method is looked up per backend."""
    spec = MethodSpec.read(item)
    return spec.method, spec.method_options()


def plan_configs(
    backends: Sequence[str], methods: Sequence[str], budgets: Sequence[int], *, anchor: str | None = "genai"
) -> list[BenchConfig]:
    """Every backend x method x budget, where the backend has the method, plus the ``anchor``
    backend's full cache (native genai; ``hf-sdpa`` for a random-weight model), the
    configuration every ratio divides by, and the full cache of every transformers baseline.

    ``methods`` items may carry options (see :func:`parse_method`). A method a listed backend
    does not have, or options it does not take, are left out for that backend (ClusterKV, or
    KVCrush's ``block_size``, on the native backend); but a method or options no listed backend
    takes, an unknown backend, or a budget a backend refuses for a method it has is an error
    naming the field. ``full`` runs once per backend.
    """
    for b in backends:
        backend_methods(b)
    configs: list[BenchConfig] = [BenchConfig(anchor, "full")] if anchor else []
    configs += [BenchConfig(b, "full") for b in backends if ALL[b].baseline and b != anchor]
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


def with_sparse_prefill(configs: list[BenchConfig], modes: Sequence[str]) -> list[BenchConfig]:
    """``configs`` and, after each, its twin in each of the sparse prefill ``modes`` its backend
    runs (``--sparse-prefill``: like compared with like, dense and sparse prompt steps side by
    side: native's, and our op's XAttention); an unknown mode, or modes no configuration's
    backend runs, is refused by name."""
    if not modes:
        return configs
    for mode in modes:
        check_choice("sparse_prefill", mode, SPARSE_PREFILL)
    if not any(m in ALL[c.backend].sparse_prefill for c in configs for m in modes):
        runs = sorted({b.name for b in ALL.values() if set(modes) & set(b.sparse_prefill)})
        raise ConfigError("sparse_prefill", ",".join(modes), f"none without backend {' or '.join(runs)}")
    out = []
    for c in configs:
        out.append(c)
        twins = [m for m in modes if m in ALL[c.backend].sparse_prefill]
        out += [replace(c, engine_options={**c.engine_options, "sparse_prefill": m}) for m in twins]
    return out


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


@dataclass
class BenchPlan:
    """What ``ov-kvcrush bench`` runs (see the module docstring).

    ``methods`` items may carry options (``kvcrush:block_size=32``). ``device`` is where the torch
    backend runs (``cpu``, ``cuda``, ``cuda:N``); the OpenVINO backends run on the CPU. ``isolate``
    runs every configuration in its own worker process (its peak RSS is its own); without it, one
    process holds every engine and the RSS column is that process's. ``batch``: sequences that
    decode together in each run (``--concurrency`` on the torch backends: one prefill of
    ``batch`` prompts of a length, then one step per token for all of them; 1: one sequence).
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
    batch: int = 1
    #: native's sparse prefill modes, each beside every genai configuration (none: dense only)
    sparse_prefill: tuple[str, ...] = ()


def device_of(cfg: BenchConfig, plan: BenchPlan) -> str:
    """Where a configuration runs: the plan's device for the torch backends, else the CPU."""
    return plan.device.lower() if ALL[cfg.backend].torch_devices else "cpu"


def speed_only(plan: BenchPlan) -> bool:
    """Whether the plan's model has random weights (``random:<architecture>``): no quality claim."""

    return is_random_model(plan.model)


def anchor_backend(plan: BenchPlan) -> str:
    """The backend whose full cache every ratio divides by: native genai, or for a random-weight
    model or a batch (which only the torch backends run) plain transformers, ``hf-sdpa``."""
    return "hf-sdpa" if speed_only(plan) or plan.batch > 1 else "genai"


def checked_plan(plan: BenchPlan) -> tuple[list[BenchConfig], list[tuple[int, int, BenchConfig]]]:
    """The plan's configurations and run order, every field checked; nothing is loaded."""
    anchor = anchor_backend(plan)
    if speed_only(plan):
        others = [b for b in plan.backends if b not in ALL or not ALL[b].torch_devices]
        if others:
            raise ConfigError(
                "backends", ",".join(others), f"{', '.join(TORCH_BACKENDS)} (a random-weight model runs on torch)"
            )
    configs = with_sparse_prefill(plan_configs(plan.backends, plan.methods, plan.budgets, anchor=anchor),
                                  plan.sparse_prefill)  # fmt: skip
    order = schedule(configs, plan.lengths, plan.repeats)
    check_int("concurrency", plan.batch, 1, MAX_BATCH)
    if plan.batch > 1 and any(not ALL[c.backend].torch_devices for c in configs):
        raise ConfigError(
            "concurrency",
            plan.batch,
            f"1 here: a batch runs on {', '.join(TORCH_BACKENDS)} (the OpenVINO backends serve --concurrency "
            "over a pool: add --kv-pool-mib)",
        )
    if plan.new_tokens < 2:
        raise ConfigError("new_tokens", plan.new_tokens, "an integer >= 2 (TPOT needs two tokens)")
    context = plan_context(plan)
    for n in plan.lengths:
        if not isinstance(n, int) or not MIN_LENGTH <= n <= (context or n + plan.new_tokens) - plan.new_tokens:
            top = f"{context - plan.new_tokens} (the model's context {context} less --new-tokens)" if context else ""
            raise ConfigError("lengths", n, f"prompt lengths in [{MIN_LENGTH}, {top or 'the context'}]")
    if any(ALL[c.backend].torch_devices for c in configs):
        from ov_kvcrush.engines.torch_device import resolve_device

        resolve_device(plan.device)  # a bad or missing device is refused before any model loads
        for name in (c.backend for c in configs if ALL[c.backend].cuda_only):
            if not plan.device.lower().startswith(("cuda", "gpu")):
                raise ConfigError("device", plan.device, f"cuda for backend {name} (it compiles CUDA graphs)")
    elif plan.device.lower() != "cpu":
        raise ConfigError(
            "device", plan.device, "cpu (--device places the torch backends; OpenVINO backends run on CPU)"
        )
    return configs, order


def plan_context(plan: BenchPlan) -> int:
    """The context of the plan's model (0: unknown), read without loading or exporting it; a
    ``--model`` that is not there, or not a model, is refused here."""

    if speed_only(plan):
        return int(random_architecture(str(plan.model))["max_position_embeddings"])
    if plan.model is None:
        return model_context(embedded_gguf_path())
    path = Path(plan.model).expanduser()
    if not (path / "openvino_model.xml").is_file():
        path = resolve_source(path).path  # a GGUF file or an HF checkpoint, checked
    return model_context(path)


def dry_run(plan: BenchPlan) -> str:
    """What :func:`run_bench` would run, checked as it would be (configurations, lengths, runs),
    without loading a model: a committed benchmark command can be checked in a test."""
    configs, order = checked_plan(plan)
    head = f"{len(configs)} configurations x {len(plan.lengths)} lengths x {plan.repeats} repeats"
    if plan.batch > 1:
        head += f" (each a batch of {plan.batch} sequences)"
    lines = [f"{head} = {len(order)} runs", *(f"  {c.label}" for c in configs)]
    lines.append("lengths: " + ", ".join(str(n) for n in plan.lengths))
    return "\n".join(lines)
