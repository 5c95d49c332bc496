"""The evaluation loop: tasks × lengths × methods × budgets on one engine, against its own full cache.

For every sample the full cache runs first (the reference for ``agreement``), then every
compressed configuration. On the torch engine one forward pass over the prompt fills every
configuration's cache (:meth:`~ov_kvcrush.engines.torch_engine.TorchEngine.generate_each`), so
a grid of 28 configurations costs one prefill plus 28 decodes; the native genai engine runs
each configuration as its own request.

Results are aggregated per ``(task, length, method, budget, backend)``: the mean score, the mean
agreement (greedy token match rate with the full cache's continuation), the KV bytes held and
the full-cache bytes for the same tokens, and for ClusterKV/Quest the top-B recall rate of what
they attended, measured against the model's real attention at every decode step.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ov_kvcrush.config import CompressionConfig, GenerationSettings, MethodSpec
from ov_kvcrush.engines.base import Capabilities
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.eval.budget import BudgetChoice, block_bytes, solve_budget
from ov_kvcrush.eval.data import DATA_TASK, read_jsonl
from ov_kvcrush.eval.scoring import agreement
from ov_kvcrush.methods import REGISTRY
from ov_kvcrush.op.probe import OpProbe
from ov_kvcrush.serving.backends import backend_info, make_engine, resolve_model
from ov_kvcrush.validation import MAX_TOKENS, check_int

# Imported where used, inside functions: what pulls in tqdm, heavy to import, so that importing this
# module stays light.

DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_BUDGETS = (128, 256, 512)
EVAL_BACKENDS = ("torch", "openvino", "genai")  # --backend's choices here, in its help's order
#: How a sample is put to the model: the chat template, or raw text and an answer prefix.
PROMPT_FORMATS = ("chat", "completion")


@dataclass(frozen=True)
class EvalPlan:
    """What one ``ov-kvcrush eval`` run measures; every field is validated, naming the field.

    Attributes:
        tasks: built-in task names (:data:`~ov_kvcrush.eval.tasks.TASKS`); ignored with ``data``.
        lengths: prompt lengths in tokens.
        methods: methods to compare (the full cache always runs as the reference; empty: every
            method the backend runs; only ``full``: the reference alone).
        budgets: token budgets per layer and KV head; ignored when ``kv_bytes``/``kv_ratio`` is set.
        kv_bytes: equal-memory targets in bytes: each method gets the budget that holds at most
            that many bytes (:func:`~ov_kvcrush.eval.budget.solve_budget`).
        kv_ratio: the same, as fractions of the full cache for the length (plus new tokens).
        samples: samples per (task, length); needles spread evenly over depths.
        seed: seeds every generator.
        backend: ``torch`` (every method), ``openvino`` (our op: the methods it runs, equal-memory
            budgets from its own block bytes) or ``genai`` (native: full, h2o, snapkv, kvcrush).
        max_new_tokens: greedy tokens generated per sample (32: five-digit answers need up to ~20).
        ppl_tokens: continuation tokens scored by the ``ppl`` task.
        data: a JSONL file of custom samples (replaces ``tasks`` and ``lengths``).
        question_after: prefill and compress each prompt's context first and ask its question
            afterwards (query-agnostic evaluation: what a later chat turn sees); torch and openvino.
        prompt_format: ``chat`` (the model's chat template around the user message) or
            ``completion`` (raw text followed by the task's answer prefix: for a pretrained
            model without chat tuning, such as the embedded Gemma 3 270M).
        model, device, dtype: the engine's (``None``: the embedded model, prepared on first use).
    """

    tasks: tuple[str, ...] = T.TASKS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    methods: tuple[MethodSpec, ...] = ()
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    kv_bytes: tuple[int, ...] = ()
    kv_ratio: tuple[float, ...] = ()
    samples: int = 1
    seed: int = 0
    backend: str = "torch"
    max_new_tokens: int = 32
    ppl_tokens: int = 64
    data: str | None = None
    question_after: bool = False
    prompt_format: str = "chat"
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in EVAL_BACKENDS:
            raise ConfigError("backend", self.backend, "one of " + ", ".join(EVAL_BACKENDS))
        unknown = [t for t in self.tasks if t not in T.TASKS]
        if unknown or not self.tasks:
            raise ConfigError("tasks", ",".join(unknown) or "(none)", "some of " + ", ".join(T.TASKS))
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError("tasks", ",".join(self.tasks), "each task once")
        if not self.lengths:
            raise ConfigError("lengths", "(none)", "at least one length")
        for n in self.lengths:
            check_int("lengths", n, 64, MAX_TOKENS)
        for b in self.budgets:
            check_int("budgets", b, 1, MAX_TOKENS)
        for b in self.kv_bytes:
            check_int("kv_bytes", b, 1, 1 << 50)
        for r in self.kv_ratio:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
                raise ConfigError("kv_ratio", r, "numbers in (0, 1] (fractions of the full cache)")
        if self.kv_bytes and self.kv_ratio:
            raise ConfigError("kv_bytes", self.kv_bytes, "unset when kv_ratio is set (one equal-memory target kind)")
        if self.data is not None and self.equal_memory:
            # the budget solver needs a prompt length; custom samples have their own lengths
            name, value = ("kv_bytes", self.kv_bytes) if self.kv_bytes else ("kv_ratio", self.kv_ratio)
            raise ConfigError(name, value, "unset with data (equal-memory budgets are solved per --lengths)")
        if not (self.budgets or self.kv_bytes or self.kv_ratio):
            raise ConfigError("budgets", "(none)", "at least one budget, or kv_bytes / kv_ratio")
        check_int("samples", self.samples, 1, 10_000)
        check_int("seed", self.seed, 0, 2**63 - 1)
        check_int("max_new_tokens", self.max_new_tokens, 1, 4096)
        check_int("ppl_tokens", self.ppl_tokens, 1, 4096)
        if not all(isinstance(m, MethodSpec) for m in self.methods):
            raise ConfigError("methods", self.methods, "MethodSpec items (MethodSpec.parse('kvcrush+2bit'))")
        runs = backend_info(self.backend).methods()
        can = self.capabilities()
        bad = [m.label for m in self.methods if m.method not in runs or (m.quant and not can.takes_method_options)]
        if bad:
            raise ConfigError("methods", ",".join(bad), f"on backend {self.backend}: " + ", ".join(runs))
        if self.equal_memory and not can.solves_kv_bytes:
            raise ConfigError(
                "kv_bytes", self.kv_bytes or self.kv_ratio, f"unset on backend {self.backend} (torch and openvino only)"
            )
        if self.equal_memory:
            scoring = [m.label for m in self.compressed() if REGISTRY[m.method].scoring_pass]
            if scoring:
                raise ConfigError(
                    "methods",
                    ",".join(scoring),
                    "methods without a scoring pass with kv_bytes / kv_ratio (the byte probes do not run "
                    "KVzip's pass; give it --budgets)",
                )
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError("prompt_format", self.prompt_format, "one of " + ", ".join(PROMPT_FORMATS))
        if self.question_after and not can.asks_question_after:
            raise ConfigError(
                "question_after", True, f"false on backend {self.backend} (torch and openvino ask it after)"
            )
        if self.question_after and "ppl" in self.tasks and self.data is None:
            raise ConfigError("tasks", "ppl", "generation tasks with question_after (ppl has no question)")
        if not can.scores_continuations and "ppl" in self.tasks and self.data is None:
            raise ConfigError(
                "tasks", "ppl", f"generation tasks on backend {self.backend} (ppl needs the torch engine)"
            )
        if "ppl" in self.tasks and self.data is None:
            for n in self.lengths:
                if self.ppl_tokens >= n:
                    raise ConfigError("ppl_tokens", self.ppl_tokens, f"below every length (got length {n})")

    @property
    def equal_memory(self) -> bool:
        return bool(self.kv_bytes or self.kv_ratio)

    def capabilities(self) -> Capabilities:
        """What the backend's engine can do (asked of its class: nothing is loaded)."""
        return backend_info(self.backend).engine_class().capabilities

    def compressed(self) -> list[MethodSpec]:
        """The compressing methods of the plan (the default: every method the backend runs)."""

        specs = list(self.methods) or [MethodSpec(m) for m in REGISTRY]
        runs = backend_info(self.backend).methods()
        return [s for s in specs if s.method in runs and s.method != "full"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["methods"] = [m.label for m in self.compressed()]
        return d


@dataclass
class EvalReport:
    """Aggregated results, per-sample records, the budgets chosen and how the run was made."""

    results: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    budgets: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"results": self.results, "budgets": self.budgets, "meta": self.meta, "samples": self.samples}


# --------------------------------------------------------------------------------------------
# engines as the runner sees them


class _Runner:
    """Runs one sample under a list of compressions on the plan's backend, asking its engine what
    it can do (:class:`~ov_kvcrush.engines.base.Capabilities`)."""

    def __init__(self, plan: EvalPlan) -> None:
        info = backend_info(plan.backend)
        self.plan = plan
        self.model_dir = resolve_model(plan.backend, plan.model)
        self.settings = GenerationSettings(
            max_new_tokens=plan.max_new_tokens, apply_chat_template=plan.prompt_format == "chat"
        )
        self.device = info.device_name(plan.device)
        options = {"dtype": plan.dtype} if "dtype" in info.options() else {}
        self.engine = make_engine(plan.backend, self.model_dir, None, self.device, **options)
        self.can: Capabilities = self.engine.capabilities
        #: engines whose compression is fixed (native), one per configuration
        self._fixed = {repr(self.engine.compression): self.engine}
        self.probe = OpProbe.for_engine(self.engine) if self.can.measures_held_bytes else None

    @property
    def shape(self) -> Any:
        """The model's attention shape (``None`` where the backend solves no budgets)."""
        return self.engine.shape if self.can.solves_kv_bytes else None

    def _engine(self, config: CompressionConfig) -> Any:
        """The engine that runs ``config``: the one engine, switched; or one per configuration."""
        if self.can.switches_compression:
            self.engine.set_compression(config)
            return self.engine
        key = repr(config)
        if key not in self._fixed:
            self._fixed[key] = make_engine(self.plan.backend, self.model_dir, config, self.device)
        return self._fixed[key]

    def count_tokens(self, text: str) -> int:
        return self.engine.count_tokens(text)

    def generate(self, prompt: str, configs: list[CompressionConfig], question: str | None = None):
        if self.can.shares_prompt:  # one pass over the prompt fills every configuration's cache
            return self.engine.generate_each(prompt, configs, self.settings, question=question)
        asked = {} if question is None else {"question": question}
        return [self._engine(c).generate(prompt, self.settings, **asked) for c in configs]

    def full_kv_bytes(self, tokens: int) -> int:
        """Bytes of the full cache for ``tokens`` tokens, in this backend's storage (our op: the
        full cache's blocks, whichever pool is set now)."""
        if self.can.measures_held_bytes:
            return self.engine.full_kv_bytes(tokens, self.engine.default_block_size)
        return self.engine.full_kv_bytes(tokens)

    def block_bytes(self) -> int:
        """The solver's precision: one block of tokens of every layer, in this backend's storage."""
        if self.can.measures_held_bytes:
            return self.full_kv_bytes(self.engine.default_block_size)
        return block_bytes(self.engine.shape)

    def held_bytes(self, length: int) -> Callable[[CompressionConfig], int] | None:
        """What measures a config's bytes at ``length`` (``None``: the torch reference's caches)."""
        probe = self.probe
        if probe is None:
            return None
        return lambda c: probe.held_bytes(c, length, self.plan.max_new_tokens)

    def perplexity(self, sample: T.PerplexitySample, configs: list[CompressionConfig]):
        return self.engine.score_continuation_each(sample.context, sample.continuation, configs)

    def tokenize_raw(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text, add_special_tokens=False).input_ids)

    def bos(self) -> int | None:
        ids = self.engine.tokenizer("x", add_special_tokens=True).input_ids
        plain = self.engine.tokenizer("x", add_special_tokens=False).input_ids
        return ids[0] if len(ids) > len(plain) else None


# --------------------------------------------------------------------------------------------
# the run


def _budgets(
    plan: EvalPlan, runner: _Runner, length: int | None, log: Callable[[str], None]
) -> tuple[dict[str, list[tuple[int, int | None]]], list[dict[str, Any]]]:
    """Per method label: ``(budget, target_bytes or None)`` pairs to run at ``length``; and the choices made.

    ``length`` is ``None`` for custom data, where the plan refuses equal-memory targets.
    """
    specs = plan.compressed()
    if not plan.equal_memory:
        return {s.label: [(b, None) for b in plan.budgets] for s in specs}, []
    assert runner.shape is not None and length is not None
    full = runner.full_kv_bytes(length + plan.max_new_tokens)
    targets = list(plan.kv_bytes) or [round(r * full) for r in plan.kv_ratio]
    out: dict[str, list[tuple[int, int | None]]] = {s.label: [] for s in specs}
    chosen: list[dict[str, Any]] = []
    block = runner.block_bytes()
    probe = runner.held_bytes(length)
    for target in targets:
        log(f"equal memory at length {length}: target {target / 2**20:.2f} MiB ({target / full:.1%} of full)")
        for s in specs:
            choice: BudgetChoice = solve_budget(
                s.label,
                lambda b, s=s: s.compression(b, track_recall=False),
                runner.shape,
                length,
                plan.max_new_tokens,
                target,
                probe=probe,
                block=block,
            )
            log("  " + choice.describe(block))
            chosen.append({"length": length, **asdict(choice), "block_bytes": block})
            if choice.budget is not None and choice.status != "fixed":
                out[s.label].append((choice.budget, target))
    return out, chosen


def run_eval(plan: EvalPlan, progress: bool = True, log: Callable[[str], None] = print) -> EvalReport:
    """Run the plan; see the module docstring for what is measured."""
    from tqdm.auto import tqdm

    data = read_jsonl(plan.data) if plan.data else None  # bad files fail before the model loads
    runner = _Runner(plan)
    t_start = time.perf_counter()
    lengths: Sequence[int | None] = [None] if data is not None else plan.lengths
    task_names = [DATA_TASK] if data is not None else list(plan.tasks)
    per_length = {}
    budget_log: list[dict[str, Any]] = []
    for length in lengths:
        per_length[length], chosen = _budgets(plan, runner, length, log)
        budget_log += chosen
    specs = {s.label: s for s in plan.compressed()}
    n_samples = len(data) if data is not None else plan.samples
    total = sum(
        (1 + sum(len(v) for v in per_length[length].values())) * n_samples * len(task_names) for length in lengths
    )
    records: list[dict[str, Any]] = []
    bar = tqdm(total=total, disable=not progress, unit="run", desc="eval")
    for length in lengths:
        grid = [(label, budget, target) for label, pairs in per_length[length].items() for budget, target in pairs]
        recall = runner.can.tracks_recall  # the op does not track the recall rate
        configs = [CompressionConfig()] + [specs[label].compression(b, track_recall=recall) for label, b, _ in grid]
        for task in task_names:
            for index in range(n_samples):
                bar.set_postfix_str(f"{task} {length or ''} #{index}")
                rows = _run_sample(plan, runner, task, length, index, n_samples, data, configs)
                for row, (label, budget, target) in zip(rows, [("full", None, None), *grid], strict=True):
                    row.update(method=label, budget=budget, target_kv_bytes=target)
                records.extend(rows)
                bar.update(len(configs))
    bar.close()
    meta = {
        "plan": plan.to_dict(),
        "model": str(runner.model_dir),
        "seconds": round(time.perf_counter() - t_start, 1),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "versions": package_versions(),
    }
    return EvalReport(results=aggregate(records), samples=records, budgets=budget_log, meta=meta)


def _run_sample(
    plan: EvalPlan,
    runner: _Runner,
    task: str,
    length: int | None,
    index: int,
    n_samples: int,
    data: list[T.Sample] | None,
    configs: list[CompressionConfig],
) -> list[dict[str, Any]]:
    """One sample under every config (the first is the full cache); one record per config."""
    base = {"task": task, "length": length, "backend": plan.backend, "index": index}
    if task == "ppl":
        assert length is not None
        ps = T.ppl_task(length, runner.tokenize_raw, plan.seed, index, plan.ppl_tokens, bos=runner.bos())
        scores = runner.perplexity(ps, configs)
        ref = scores[0].predicted
        return [
            {
                **base,
                "metric": "perplexity",
                "score": s.perplexity,
                "agreement": agreement(s.predicted, ref),
                "kv_bytes": s.kv_bytes,
                "full_kv_bytes": s.full_kv_bytes,
                "prompt_tokens": len(ps.context),
                "recall_rate": s.counters.get("recall_rate"),
            }
            for s in scores
        ]
    if data is not None:
        sample = data[index]
    else:
        assert length is not None
        sample = T.GENERATION_TASKS[task](length, runner.count_tokens, plan.seed, index, n_samples)
    question = None
    # completion: the answer's first words follow the prompt (they end the question too)
    answer = "\n" + sample.answer_prefix if plan.prompt_format == "completion" and sample.answer_prefix else ""
    if plan.question_after:
        if not sample.question:
            raise UserError(f"sample {index} of {task} says no question: --question-after needs one ('question')")
        question = sample.question + answer
    results = runner.generate(sample.prompt + answer, configs, question)
    ref = results[0].token_ids
    return [
        {
            **base,
            "metric": "accuracy",
            "score": sample.score(r.text),
            "agreement": agreement(r.token_ids, ref),
            "kv_bytes": r.kv_bytes,
            "full_kv_bytes": r.full_kv_bytes,
            "prompt_tokens": r.prompt_tokens,
            "recall_rate": r.counters.get("recall_rate"),
            "depth": sample.depth,
            "answers": list(sample.answers),
            "output": r.text,
        }
        for r in results
    ]


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean of every measure per ``(task, length, method, budget, backend, target_kv_bytes)``, with ``n``."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        key = (r["task"], r["length"], r["method"], r["budget"], r["backend"], r.get("target_kv_bytes"))
        groups.setdefault(key, []).append(r)
    out = []
    for (task, length, method, budget, backend, target), rows in groups.items():
        recall = [r["recall_rate"] for r in rows if r.get("recall_rate") is not None]
        entry = {
            "task": task,
            "length": length,
            "method": method,
            "budget": budget,
            "backend": backend,
            "metric": rows[0]["metric"],
            "score": mean(r["score"] for r in rows),
            "agreement": mean(r["agreement"] for r in rows),
            "kv_bytes": round(mean(r["kv_bytes"] for r in rows)),
            "full_kv_bytes": round(mean(r["full_kv_bytes"] for r in rows)),
            "n": len(rows),
            "prompt_tokens": round(mean(r["prompt_tokens"] for r in rows)),
        }
        if rows[0]["metric"] == "perplexity":
            entry["log_perplexity"] = mean(math.log(r["score"]) for r in rows)
        if recall:
            entry["recall_rate"] = mean(recall)
        if target is not None:
            entry["target_kv_bytes"] = target
        out.append(entry)
    return out


def mean(values) -> float:
    """Arithmetic mean; NaN for no values (a cell with nothing to average shows as ``-``)."""
    vals = list(values)
    return sum(vals) / len(vals) if vals else float("nan")


def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on (results carry them; bench and eval alike)."""

    out = {}
    for pkg in ("ov_kvcrush", "torch", "transformers", "openvino", "openvino-genai"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out
