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
from typing import Any

from ov_kvcrush.config import STORE_WIDTHS, CompressionConfig, GenerationSettings, split_store
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.eval.budget import BudgetChoice, block_bytes, solve_budget
from ov_kvcrush.eval.data import DATA_TASK, read_jsonl
from ov_kvcrush.eval.scoring import agreement
from ov_kvcrush.methods import REGISTRY, QuantSettings, methods_for
from ov_kvcrush.validation import MAX_TOKENS, check_int

DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_BUDGETS = (128, 256, 512)
EVAL_BACKENDS = ("torch", "openvino", "genai")
#: How a sample is put to the model: the chat template, or raw text and an answer prefix.
PROMPT_FORMATS = ("chat", "completion")


@dataclass(frozen=True)
class MethodSpec:
    """A method as the evaluation names it: a registry name, optionally with method options
    (``snapkv:block_size=32``) and over a quantized store (``name+2bit``, ``name+4bit``,
    ``name+k2v4`` for keys 2 and values 4 bits), e.g. ``snapkv:block_size=32+4bit``."""

    method: str
    quant: bool = False
    store: str = "2bit"
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        from ov_kvcrush.config import parse_options

        allowed = (
            "registry names ("
            + ", ".join(REGISTRY)
            + "), optionally with :KEY=VALUE options and +"
            + ", +".join(STORE_WIDTHS)
        )
        try:
            head, store = split_store(text)
        except ConfigError:
            raise ConfigError("methods", text, allowed) from None
        name, *opts = head.split(":")
        if name not in REGISTRY:
            raise ConfigError("methods", text, allowed)
        field = REGISTRY[name].__dataclass_fields__.get("quant")
        quantized_already = field is not None and field.default is not None  # MiniKV: 2-bit by default
        if store and (field is None or (quantized_already and store == "2bit")):
            raise ConfigError("methods", text, f"+{store} on a method whose store is full precision ({name} cannot)")
        options = tuple(sorted(parse_options(opts, flag=f"--methods {name}:").items()))
        spec = cls(name, bool(store), store or "2bit", options)
        if name != "full":
            spec.compression(None if not REGISTRY[name].needs_budget else 4096).method_config()  # names a bad option
        return spec

    @property
    def label(self) -> str:
        opts = "".join(f":{k}={v}" for k, v in self.options)
        return self.method + opts + (f"+{self.store}" if self.quant else "")

    def compression(self, budget: int | None, track_recall: bool = True) -> CompressionConfig:
        """The config at ``budget`` (recall methods also measure their top-B recall rate)."""
        if self.method == "full":
            return CompressionConfig()
        options: dict[str, Any] = dict(self.options)
        if self.quant:
            kbits, vbits = STORE_WIDTHS[self.store]
            options["quant"] = QuantSettings(key_bits=kbits, value_bits=vbits)
        if track_recall and "track_recall" in REGISTRY[self.method].__dataclass_fields__:  # a recall method
            options["track_recall"] = True
        # the windows are CompressionConfig's own fields, not method options
        sinks, recent = options.pop("sink_tokens", None), options.pop("recent_tokens", None)
        return CompressionConfig(self.method, budget, sink_tokens=sinks, recent_tokens=recent, options=options)


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
        if self.backend == "openvino":
            bad = [m.label for m in self.methods if m.method not in methods_for("openvino")]
            if bad:
                raise ConfigError(
                    "methods", ",".join(bad), "on backend openvino: " + ", ".join(methods_for("openvino"))
                )
        if self.backend == "genai":
            bad = [m.label for m in self.methods if m.method not in methods_for("genai") or m.quant]
            if bad:
                raise ConfigError("methods", ",".join(bad), "on backend genai: " + ", ".join(methods_for("genai")))
            if self.equal_memory:
                raise ConfigError(
                    "kv_bytes", self.kv_bytes or self.kv_ratio, "unset on backend genai (torch and openvino only)"
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
        if self.question_after and self.backend == "genai":
            raise ConfigError("question_after", True, "false on backend genai (torch and openvino ask it after)")
        if self.question_after and "ppl" in self.tasks and self.data is None:
            raise ConfigError("tasks", "ppl", "generation tasks with question_after (ppl has no question)")
        if self.backend != "torch" and "ppl" in self.tasks and self.data is None:
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

    def compressed(self) -> list[MethodSpec]:
        """The compressing methods of the plan (the default: every method the backend runs)."""

        specs = list(self.methods) or [MethodSpec(m) for m in REGISTRY]
        if self.backend != "torch":
            specs = [s for s in specs if s.method in methods_for(self.backend)]
        return [s for s in specs if s.method != "full"]

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
    """Runs one sample under a list of compressions on the plan's backend."""

    def __init__(self, plan: EvalPlan) -> None:
        from ov_kvcrush.engines import resolve_model

        self.plan = plan
        self.model_dir = resolve_model(plan.backend, plan.model)
        self.settings = GenerationSettings(
            max_new_tokens=plan.max_new_tokens, apply_chat_template=plan.prompt_format == "chat"
        )
        if plan.backend == "torch":
            from ov_kvcrush.engines.torch_engine import TorchEngine

            self.torch = TorchEngine(self.model_dir, device=plan.device, dtype=plan.dtype)
            self.shape = self.torch.shape
            self._count = lambda text: len(self.torch.tokenizer(text, add_special_tokens=False).input_ids)
        elif plan.backend == "openvino":
            from ov_kvcrush.engines.openvino_engine import OpenVINOEngine
            from ov_kvcrush.op.probe import OpProbe

            self.torch = None
            self.openvino = OpenVINOEngine(self.model_dir, device=plan.device.upper())
            self.shape = self.openvino.shape
            self.probe = OpProbe.for_engine(self.openvino)
            tok = self.openvino.tokenizer
            self._count = lambda text: len(tok.encode(text, add_special_tokens=False).input_ids.data[0])
        else:
            self.torch = None
            self.shape = None
            self._genai: dict[str, Any] = {}
            ref = self._genai_engine(CompressionConfig())
            self._count = lambda text: len(ref.tokenizer.encode(text, add_special_tokens=False).input_ids.data[0])

    def _genai_engine(self, config: CompressionConfig):
        from ov_kvcrush.engines.genai import GenAIEngine

        key = repr(config)
        if key not in self._genai:
            self._genai[key] = GenAIEngine(self.model_dir, config, device=self.plan.device.upper())
        return self._genai[key]

    def count_tokens(self, text: str) -> int:
        return self._count(text)

    def generate(self, prompt: str, configs: list[CompressionConfig], question: str | None = None):
        if self.torch is not None:
            return self.torch.generate_each(prompt, configs, self.settings, question=question)
        if self.plan.backend == "openvino":  # one compiled model, a pool per method
            out = []
            for c in configs:
                self.openvino.set_compression(c)
                out.append(self.openvino.generate(prompt, self.settings, question=question))
            return out
        return [self._genai_engine(c).generate(prompt, self.settings) for c in configs]

    def full_kv_bytes(self, tokens: int) -> int:
        """Bytes of the full cache for ``tokens`` tokens, in this backend's storage."""
        if self.plan.backend == "openvino":  # the full cache's blocks, whichever pool is set now
            return self.openvino.full_kv_bytes(tokens, self.openvino.default_block_size)
        assert self.shape is not None
        return self.shape.full_kv_bytes(tokens)

    def block_bytes(self) -> int:
        """The solver's precision: one block of tokens of every layer, in this backend's storage."""
        if self.plan.backend == "openvino":
            return self.full_kv_bytes(self.openvino.default_block_size)
        assert self.shape is not None
        return block_bytes(self.shape)

    def held_bytes(self, length: int) -> Callable[[CompressionConfig], int] | None:
        """What measures a config's bytes at ``length`` (``None``: the torch reference's caches)."""
        if self.plan.backend != "openvino":
            return None
        return lambda c: self.probe.held_bytes(c, length, self.plan.max_new_tokens)

    def perplexity(self, sample: T.PerplexitySample, configs: list[CompressionConfig]):
        assert self.torch is not None
        return self.torch.score_continuation_each(sample.context, sample.continuation, configs)

    def tokenize_raw(self, text: str) -> list[int]:
        assert self.torch is not None
        return list(self.torch.tokenizer(text, add_special_tokens=False).input_ids)

    def bos(self) -> int | None:
        assert self.torch is not None
        ids = self.torch.tokenizer("x", add_special_tokens=True).input_ids
        plain = self.torch.tokenizer("x", add_special_tokens=False).input_ids
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
        recall = plan.backend == "torch"  # the op does not track the recall rate
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
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("ov_kvcrush", "torch", "transformers", "openvino", "openvino-genai"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out
