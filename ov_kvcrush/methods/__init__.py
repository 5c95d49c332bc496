"""Reference implementations of every KV-cache method, in torch (CPU or CUDA).

Each method is one module: a small frozen config dataclass (documented defaults, validated) plus
its algorithm, written as pure functions and a per-layer cache (:class:`LayerCache`) that the
engines drive. These define the semantics every fast path (the C++ OpenVINO op, CUDA) is tested
against.

``REGISTRY`` maps the method names used everywhere (configs, CLI flags, reports) to their config
classes. Each class declares the runtimes that run it and the options each refuses
(:attr:`MethodConfig.runtimes`, :mod:`~ov_kvcrush.methods.runtimes`), and everything that lists
or refuses methods per runtime or engine is derived here (:func:`require`, :func:`methods_on`,
:func:`methods_for`, :func:`methods_table`, :func:`support_table`). How to add a method, file by
file: ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import AttentionOutput, ShapeError, attend
from ov_kvcrush.methods.base import ENGINES, LayerCache, MethodConfig, QuantSettings
from ov_kvcrush.methods.chelsea import ChelseaConfig
from ov_kvcrush.methods.clusterkv import ClusterKVConfig
from ov_kvcrush.methods.full import FullConfig
from ov_kvcrush.methods.importance import H2OConfig, PyramidKVConfig, SnapKVConfig, StreamingLLMConfig
from ov_kvcrush.methods.knorm import KnormConfig
from ov_kvcrush.methods.kvcrush import KVCrushConfig
from ov_kvcrush.methods.kvzip import KVzipConfig
from ov_kvcrush.methods.minikv import MiniKVConfig
from ov_kvcrush.methods.quest import QuestConfig
from ov_kvcrush.methods.runtimes import BY_NAME, RUNTIMES, refusal, runs_method, support_cell
from ov_kvcrush.validation import check_choice

REGISTRY: dict[str, type[MethodConfig]] = {
    "full": FullConfig,
    "streamingllm": StreamingLLMConfig,
    "h2o": H2OConfig,
    "snapkv": SnapKVConfig,
    "pyramidkv": PyramidKVConfig,
    "kvcrush": KVCrushConfig,
    "clusterkv": ClusterKVConfig,
    "quest": QuestConfig,
    "chelsea": ChelseaConfig,
    "minikv": MiniKVConfig,
    "knorm": KnormConfig,
    "kvzip": KVzipConfig,
}


def method_config(name: str, product: bool = False, /, **fields: Any) -> MethodConfig:
    """Build the config of method ``name`` from keyword fields (``quant=True`` means default 2-bit
    settings; a dict such as ``{"bits": 4}`` sets :class:`QuantSettings` fields; ``preset="paper"``
    starts from the fields of one of the class's :attr:`~MethodConfig.presets`).

    Fields are layered, each over the one before: the class's :attr:`~MethodConfig.engine_defaults`
    (with ``product``, positional so that no field name can clash with it: what the engines
    resolve on a model), the preset, the fields given.

    Raises :class:`~ov_kvcrush.errors.ConfigError` for an unknown method or field.
    """
    if name not in REGISTRY:
        raise ConfigError("method", name, "one of " + ", ".join(REGISTRY))
    cls = REGISTRY[name]
    preset = fields.pop("preset", None)
    if preset is not None and (not isinstance(preset, str) or preset not in cls.presets):
        allowed = ("one of " + ", ".join(cls.presets)) if cls.presets else f"unset (method {name} has no presets)"
        raise ConfigError("preset", preset, allowed)
    fields = {
        **(cls.engine_defaults if product else {}),
        **(cls.presets[preset] if preset is not None else {}),
        **fields,
    }
    if fields.get("quant") is True:
        fields["quant"] = QuantSettings()
    elif isinstance(fields.get("quant"), dict):
        allowed = [f.name for f in dataclasses.fields(QuantSettings)]
        bad = sorted(set(fields["quant"]) - set(allowed))
        if bad:
            raise ConfigError(f"quant.{bad[0]}", fields["quant"][bad[0]], "a field of quant: " + ", ".join(allowed))
        fields["quant"] = QuantSettings(**fields["quant"])
    known = {f.name for f in dataclasses.fields(cls) if f.init}  # not the class constants (name, engines ...)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(unknown[0], fields[unknown[0]], f"a field of {name}: " + ", ".join(sorted(known)))
    return cls(**fields)


def methods_for(engine: str) -> tuple[str, ...]:
    """The registry names ``engine`` runs (``torch``, ``openvino`` or ``genai``), in registry order."""
    check_choice("engine", engine, ENGINES)
    return tuple(name for name, cls in REGISTRY.items() if engine in cls.engines)


def methods_by_engine() -> str:
    """``genai: ...; openvino: ...; torch: ...``: the methods each engine runs, for help texts."""
    return "; ".join(f"{engine}: " + ", ".join(methods_for(engine)) for engine in sorted(ENGINES))


def methods_on(runtime: str) -> tuple[str, ...]:
    """The methods ``runtime`` runs (some of their configs), in registry order."""
    check_choice("runtime", runtime, tuple(BY_NAME))
    return tuple(name for name, cls in REGISTRY.items() if runs_method(cls, runtime))


def require(config: MethodConfig, runtime: str) -> None:
    """Raise :class:`~ov_kvcrush.errors.ConfigError` unless ``runtime`` runs ``config``: it names
    the method (or the option refused), what the runtime takes, and where the method (with that
    option) does run. Every runtime refuses through here."""
    rt = BY_NAME[runtime]
    if not runs_method(type(config), runtime):
        elsewhere = "; ".join(BY_NAME[r].title for r in config.runtimes)
        why = config.not_run_because.get(runtime)
        raise ConfigError(
            "method",
            config.name,
            f"one of {', '.join(methods_on(runtime))} ({rt.title}"
            + (f"; not {config.name}: {why}" if why else "")
            + f"); {config.name} runs on: {elsewhere}",
        )
    refused = refusal(config, runtime)
    if refused is not None:
        elsewhere = "; ".join(
            BY_NAME[r].title for r, rs in config.runtimes.items() if all(x.option != refused.option for x in rs)
        )
        raise ConfigError(
            f"options.{refused.option}",
            getattr(config, refused.option),
            f"{refused.allowed} ({rt.title}); {config.name} with this {refused.option} runs on: {elsewhere}",
        )


def support_table() -> str:
    """``docs/support.md``: every method against every runtime, with the options each refuses.

    The page holds it verbatim (a test compares); regenerate with ``python -c "from
    ov_kvcrush.methods import support_table; print(support_table(), end='')" > docs/support.md``.
    """
    head = [
        "# Where each method runs",
        "",
        "Generated from the methods' declarations (`MethodConfig.runtimes`; a test holds this page to the",
        "code). A blank cell: the runtime does not run the method (*no: ...*: why not, where a user",
        "would reach for it); *yes, not ...*: it runs the method except with those options. Where the",
        "CUDA fast path does not run a config, the torch engine runs the reference instead; every other",
        "runtime refuses the config with an error that names the option and the runtimes that run it.",
        "",
        "| runtime | how to reach it |",
        "|---|---|",
        *(f"| `{r.name}` | {r.title} |" for r in RUNTIMES),
        "",
        "| method | " + " | ".join(f"`{r.name}`" for r in RUNTIMES) + " |",
        "|---|" + "---|" * len(RUNTIMES),
    ]
    rows = [
        f"| `{name}` | " + " | ".join(support_cell(cls, r.name) for r in RUNTIMES) + " |"
        for name, cls in REGISTRY.items()
    ]
    return "\n".join(head + rows) + "\n"


def methods_table() -> str:
    """The README's methods table (Markdown): each method, what it does, how its default departs
    from its paper, its module and its engines (the short form of :func:`support_table`, which
    ``docs/support.md`` holds: every runtime and the options each refuses).

    The README holds it verbatim (a test compares); regenerate with
    ``python -c "from ov_kvcrush.methods import methods_table; print(methods_table())"``.
    """
    rows = [
        "| name | what it keeps / does | default, against its paper | module | " + " | ".join(ENGINES) + " |",
        "|---|---|---|---|" + "---|" * len(ENGINES),
    ]
    for name, cls in REGISTRY.items():
        summary = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
        module = cls.__module__.rsplit(".", 1)[-1] + ".py"
        marks = " | ".join("yes" if e in cls.engines else "" for e in ENGINES)
        rows.append(f"| `{name}` | {summary} | {cls.departure} | `{module}` | {marks} |")
    return "\n".join(rows)


__all__ = [
    "ENGINES",
    "REGISTRY",
    "AttentionOutput",
    "ChelseaConfig",
    "ClusterKVConfig",
    "FullConfig",
    "H2OConfig",
    "KVCrushConfig",
    "KVzipConfig",
    "KnormConfig",
    "LayerCache",
    "MethodConfig",
    "MiniKVConfig",
    "PyramidKVConfig",
    "QuantSettings",
    "QuestConfig",
    "ShapeError",
    "SnapKVConfig",
    "StreamingLLMConfig",
    "attend",
    "method_config",
    "methods_by_engine",
    "methods_for",
    "methods_on",
    "methods_table",
    "require",
    "support_table",
]
