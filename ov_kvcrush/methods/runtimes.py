"""Where each method runs: the runtimes, and per method the options each runtime refuses.

A method's config class declares, in one place (:attr:`~ov_kvcrush.methods.MethodConfig.runtimes`),
every runtime that runs it and what that runtime refuses of its options. Every runtime asks these
declarations, never a list of its own: its refusal names the option, what the runtime takes
instead and the runtimes that do run the method as configured; the methods table, the help
texts and the support table (``docs/support.md``) are drawn from the same declarations. Each
runtime keeps only how it builds a method's layer, registered by method name (the CUDA fast
path's ``FAST_LAYERS``, the Intel GPU pool's ``DEVICE_LAYERS``, the C++ op's
``OVKC_REGISTER_POLICY``), and a test holds every registration to the declarations.

The registry-wide views (:func:`~ov_kvcrush.methods.require`, :func:`~ov_kvcrush.methods.methods_on`,
:func:`~ov_kvcrush.methods.support_table`) sit beside the registry in :mod:`ov_kvcrush.methods`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Runtime:
    """One place a method's layers run.

    Attributes:
        name: how declarations name it (``cuda``).
        title: how a user reaches it, for tables and errors.
        engine: the backend that drives it (``torch``, ``openvino``, ``genai``).
        default_device: whether it is the backend's run on its default device (the CPU; a
            backend runs a method when one of these runtimes does: CUDA and the Intel GPU are
            where it runs besides).
    """

    name: str
    title: str
    engine: str
    default_device: bool = True


REFERENCE = Runtime("reference", "backend torch, the reference (CPU or CUDA)", "torch")
CUDA = Runtime("cuda", "backend torch on CUDA, the fast path", "torch", default_device=False)
CPU_OP = Runtime("cpu-op", "backend openvino, our op (CPU)", "openvino")
GPU_PLUGIN = Runtime(
    "gpu-plugin", "backend openvino, device GPU (our GPU plugin layers)", "openvino", default_device=False
)
GPU_POOL = Runtime("gpu-pool", "backend torch, paged_device (the Intel GPU pool)", "torch", default_device=False)
NATIVE = Runtime("genai", "backend genai, native openvino_genai eviction (its own settings, no options)", "genai")

#: every runtime, in the support table's order
RUNTIMES: tuple[Runtime, ...] = (REFERENCE, CUDA, CPU_OP, GPU_PLUGIN, GPU_POOL, NATIVE)
BY_NAME: dict[str, Runtime] = {r.name: r for r in RUNTIMES}


@dataclass(frozen=True)
class Refusal:
    """An option a runtime does not run.

    Attributes:
        option: the config's field (``quant``, ``track_recall``, ``head_budgets``, ``block_size``).
        what: what is refused, in the words of the support table.
        allowed: what the runtime takes instead, in the words of an error.
        applies: whether a config sets the refused option.
    """

    option: str
    what: str
    allowed: str
    applies: Callable[[Any], bool]


#: the options runtimes refuse, shared by the declarations
TWO_BIT_STORE = Refusal("quant", "the 2-bit store", "None (the full-precision store)", lambda c: c.quant is not None)
FULL_PRECISION_STORE = Refusal("quant", "the full-precision store", "set (the 2-bit store)", lambda c: c.quant is None)
RECALL_TRACKING = Refusal(
    "track_recall", "recall tracking", "false (the reference tracks recall)", lambda c: c.track_recall
)
ADAPTIVE_HEAD_BUDGETS = Refusal(
    "head_budgets", "adaptive head budgets", "uniform", lambda c: c.head_budget_mode() != "uniform"
)
SPANS = Refusal("block_size", "spans", "None (single tokens)", lambda c: c.span_tokens() is not None)

#: a declaration: runtime name -> the options it refuses (none: every config of the method runs)
Declaration = Mapping[str, tuple[Refusal, ...]]


def check_declaration(method: str, declared: Declaration, not_run_because: Mapping[str, str]) -> None:
    """A declaration names known runtimes only, and the reference always (the oracle of every
    other); a reason a runtime does not run the method, only for a known runtime not declared."""
    unknown = sorted(set(declared) - set(BY_NAME))
    if unknown or REFERENCE.name not in declared or declared[REFERENCE.name]:
        raise TypeError(
            f"method {method}: runtimes {sorted(declared)} (known: {', '.join(BY_NAME)}; the reference, whole)"
        )
    wrong = sorted(r for r in not_run_because if r not in BY_NAME or r in declared)
    if wrong:
        raise TypeError(f"method {method}: not_run_because names {wrong}: runtimes it does not declare only")


def engines_of(declared: Declaration) -> tuple[str, ...]:
    """The backends that run a method on their default device (the CPU), in :data:`RUNTIMES`
    order (each once): Quest, which the openvino backend runs on an Intel GPU alone, is not one
    of its methods (the support table says where else each method runs)."""
    return tuple(dict.fromkeys(r.engine for r in RUNTIMES if r.name in declared and r.default_device))


def refusal(config: Any, runtime: str) -> Refusal | None:
    """The first option of ``config`` that ``runtime`` refuses (``None``: it runs ``config``).
    The runtime must run the method at all (:func:`runs_method`)."""
    return next((r for r in config.runtimes[runtime] if r.applies(config)), None)


def runs_method(cls: type[Any], runtime: str) -> bool:
    """Whether ``runtime`` runs some configs of the method ``cls``."""
    return runtime in cls.runtimes


def runs(config: Any, runtime: str) -> bool:
    """Whether ``runtime`` runs ``config`` as it is."""
    return runs_method(type(config), runtime) and refusal(config, runtime) is None


def refuses_option(cls: type[Any], runtime: str, option: str) -> bool:
    """Whether ``runtime`` runs the method ``cls`` but refuses its ``option``."""
    return runs_method(cls, runtime) and any(r.option == option for r in cls.runtimes[runtime])


def support_cell(cls: type[Any], runtime: str) -> str:
    """A table cell: blank where the runtime does not run the method (``no: ...`` where the method
    says why), ``yes`` where it runs every config, else the options it refuses."""
    if not runs_method(cls, runtime):
        why = cls.not_run_because.get(runtime)
        return f"no: {why}" if why else ""
    refused = cls.runtimes[runtime]
    if not refused:
        return "yes"
    return "yes, not " + ", ".join(f"{r.what} (`{r.option}`)" for r in refused)
