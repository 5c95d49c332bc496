"""The backends by name, and the one factory of their engines: the only place a backend's name is
looked up.

Everything else asks a backend's :class:`Backend` (what model it runs, what its ``--device``
means, whether it is native ``openvino_genai`` or transformers' own cache) or its engine's
:class:`~ov_kvcrush.engines.base.Capabilities` (a chat cache, a question after its context, a
continuous-batching loop, recall tracking ...), never ``backend == ...``. The engine classes are
imported when first asked for (the torch engine's transformers takes seconds to import).

``genai``, ``torch`` and ``openvino`` are what a user picks (:data:`BACKENDS`); the bench also
runs transformers' own caches as speed anchors (``hf-sdpa``, ``hf-static-compiled``).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ov_kvcrush.config import SPARSE_PREFILL, CompressionConfig, to_native_scheduler_config
from ov_kvcrush.engines.random_model import is_random_model, random_architecture
from ov_kvcrush.errors import ConfigError, UserError, one_line
from ov_kvcrush.models.export import ensure_default_model, export_model, hf_checkpoint
from ov_kvcrush.op.kvcache import DEFAULT_BLOCK_SIZE

# Imported where used, below: the methods and torch's device check (torch takes seconds to import;
# ``LLMPipeline(backend="genai")`` and ``ov-kvcrush --help`` never need it).


def _native_constraints(compression: CompressionConfig) -> None:
    to_native_scheduler_config(compression, "CPU")  # block multiples, native methods and fields


def _op_constraints(compression: CompressionConfig) -> None:
    from ov_kvcrush.op.method_spec import method_spec  # the methods: torch (see the imports)

    method_spec(compression.method_config().model_free(), 1, 1, DEFAULT_BLOCK_SIZE)  # e.g. block-wise on the pool's


def _no_constraints(compression: CompressionConfig) -> None:
    """The method's own checks (its config) are all there is."""


@dataclass(frozen=True)
class Backend:
    """What a backend runs and how it is reached.

    Attributes:
        name: as ``--backend`` names it.
        engine: its engine class, ``module:Class`` (imported on first use).
        family: the engine family whose methods it runs (``methods_for``): ``torch``,
            ``openvino`` or ``genai``.
        exported_ir: it runs an exported OpenVINO IR (else a Hugging Face checkpoint).
        torch_devices: ``device`` is torch's (``cpu``, ``cuda``); else OpenVINO's (``CPU``, ``GPU``).
        random_models: it builds ``random:<architecture>`` models (speed only).
        native: native ``openvino_genai``: the anchor of our comparisons, its compression fixed
            per engine, able to read a GGUF file itself.
        baseline: transformers' own cache (the bench's speed anchors): the full cache only.
        cuda_only: it runs on a CUDA device only (a compiled static cache's CUDA graphs).
        constraints: what a compression must meet beyond its method's own checks on this backend.
        engine_options: keyword arguments its engine is always given.
        sparse_prefill: the sparse prompt attention modes its engine's ``sparse_prefill`` runs.
    """

    name: str
    engine: str
    family: str
    exported_ir: bool = False
    torch_devices: bool = False
    random_models: bool = False
    native: bool = False
    baseline: bool = False
    cuda_only: bool = False
    constraints: Callable[[CompressionConfig], None] = _no_constraints
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    sparse_prefill: tuple[str, ...] = ()

    def engine_class(self) -> type:
        module, _, name = self.engine.partition(":")
        return getattr(importlib.import_module(module), name)

    def options(self) -> tuple[str, ...]:
        """The keyword options its engine takes (beyond the model, the compression and the device)."""
        given = ("model_dir", "compression", "device", *self.engine_options)
        return tuple(n for n in inspect.signature(self.engine_class()).parameters if n not in given)

    def methods(self) -> tuple[str, ...]:
        """The methods it runs (``full`` included)."""
        from ov_kvcrush.methods import methods_for  # torch (see the imports)

        return ("full",) if self.baseline else methods_for(self.family)

    def device_name(self, device: str) -> str:
        """``device`` as this backend names it (torch's lower case, OpenVINO's upper)."""
        return device.lower() if self.torch_devices else device.upper()


#: every backend, by name
ALL: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "genai", "ov_kvcrush.engines.genai:GenAIEngine", "genai", exported_ir=True, native=True,
            constraints=_native_constraints, sparse_prefill=SPARSE_PREFILL,
        ),
        Backend(
            "openvino", "ov_kvcrush.serving.openvino_engine:OpenVINOEngine", "openvino", exported_ir=True,
            constraints=_op_constraints, sparse_prefill=("xattention",),
        ),
        Backend(
            "torch", "ov_kvcrush.engines.torch_engine:TorchEngine", "torch", torch_devices=True, random_models=True
        ),
        Backend(
            "hf-sdpa", "ov_kvcrush.engines.hf_baseline:HFBaselineEngine", "torch", torch_devices=True,
            random_models=True, baseline=True, engine_options={"backend": "hf-sdpa"},
        ),
        Backend(
            "hf-static-compiled", "ov_kvcrush.engines.hf_baseline:HFBaselineEngine", "torch", torch_devices=True,
            random_models=True, baseline=True, cuda_only=True, engine_options={"backend": "hf-static-compiled"},
        ),
    )
}  # fmt: skip
#: what a user picks (``--backend``), in its help's order: every backend but transformers' own baselines
BACKENDS = ("genai", "torch", "openvino")
#: Backend name → the issue that brings it, for those not built yet.
PLANNED_BACKENDS: dict[str, int] = {}


def check_backend(backend: str, known: tuple[str, ...] = BACKENDS) -> Backend:
    """The backend named ``backend`` among ``known``, or an error naming the field."""
    if not isinstance(backend, str):
        raise ConfigError("backend", backend, "one of " + ", ".join(known))
    if backend in PLANNED_BACKENDS:
        raise UserError(
            f"--backend={backend} is not built yet (issue #{PLANNED_BACKENDS[backend]}); available: " + ", ".join(known)
        )
    if backend not in known:
        raise UserError(f"--backend={backend!r} is invalid: allowed {', '.join(known)}")
    return ALL[backend]


def backend_info(backend: str) -> Backend:
    """Any backend, the bench's transformers baselines included (:data:`ALL`), by name."""
    return check_backend(backend, tuple(ALL))


def taking(option: str) -> tuple[str, ...]:
    """The user's backends whose engines take ``option`` (for an error that names them)."""
    return tuple(name for name in BACKENDS if option in ALL[name].options())


def check_option(backend: str, option: str, flag: str) -> None:
    """A :class:`~ov_kvcrush.errors.UserError` naming ``flag`` and the backends it is for, unless
    ``backend``'s engine takes ``option``."""
    if option not in backend_info(backend).options():
        raise UserError(f"{flag} is for --backend {', '.join(taking(option))}, got --backend={backend}")


def engine_options(backend: str, flags: Mapping[str, tuple[str, Any, Any]]) -> dict[str, Any]:
    """The engine options that command-line flags set: ``flags`` maps an option to ``(flag, value,
    default)``; a flag set away from its default must be an option of ``backend``'s engine
    (:func:`check_option`), and only those are passed."""
    out = {}
    for option, (flag, value, default) in flags.items():
        if value != default:
            check_option(backend, option, flag)
            out[option] = value
    return out


def resolve_model(backend: str, model: str | Path | None) -> Path | str:
    """The model path ``backend`` runs: an IR directory (genai, openvino) or an HF checkpoint (torch).

    ``None`` is the embedded model. A GGUF file or an HF directory is exported (genai) or
    converted (torch) once and cached; an exported IR directory is used as is by genai.
    ``random:<architecture>`` (torch only) is returned as it is: the engine builds it
    (:mod:`ov_kvcrush.engines.random_model`).
    """
    info = backend_info(backend)
    try:
        return _resolve_model(info, model)
    except (RuntimeError, ValueError, OSError, EOFError) as exc:
        if isinstance(exc, UserError):
            raise
        where = model or "(the embedded model)"
        raise UserError(
            f"cannot read the model {where} for backend {backend} (is the file complete?): {one_line(exc)}"
        ) from exc


def _resolve_model(info: Backend, model: str | Path | None) -> Path | str:
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError("model", model, "a path (str or os.PathLike), or None for the embedded model")
    if is_random_model(model):
        if not info.random_models:
            raise ConfigError(
                "model", model, f"a model path for backend {info.name} (random weights run on torch only)"
            )
        random_architecture(str(model))  # an unknown architecture is refused here, listing the known ones
        return str(model)
    if info.exported_ir:
        if model is None:
            return ensure_default_model()
        path = Path(model).expanduser()
        return path if (path / "openvino_model.xml").is_file() else export_model(path)
    if model is not None and (Path(model).expanduser() / "openvino_model.xml").is_file():
        raise UserError(
            f"--backend torch needs a Hugging Face checkpoint or a GGUF file, got an OpenVINO IR directory: {model}"
        )
    return hf_checkpoint(model)


def make_engine(
    backend: str,
    model_dir: str | Path,
    compression: CompressionConfig | None = None,
    device: str = "CPU",
    **options: Any,
) -> Any:
    """Create the engine for ``backend`` on an already resolved model (see :func:`resolve_model`).

    ``options`` are the engine's own keyword arguments; one it does not take is refused by name
    with the ones it does. A model the runtime cannot load (a truncated GGUF, a broken IR) is a
    :class:`~ov_kvcrush.errors.UserError` naming the file, not the runtime's traceback.
    """
    info = backend_info(backend)
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError("model", model_dir, "a path (str or os.PathLike)")
    if not isinstance(device, str):
        raise ConfigError("device", device, "a device name such as CPU or cuda")
    if compression is not None and not isinstance(compression, CompressionConfig):
        raise ConfigError("compression", compression, "a CompressionConfig")
    if info.torch_devices:
        from ov_kvcrush.engines.torch_device import resolve_device  # torch (see the imports)

        resolve_device(device)  # refused before the engine's modules load (transformers': seconds)
    taken = info.options()
    for name, value in options.items():
        if name not in taken:
            raise ConfigError(name, value, f"an option of backend {backend}: " + ", ".join(taken))
    if options.get("properties") is not None and not isinstance(options["properties"], Mapping):
        raise ConfigError("properties", options["properties"], "a mapping of OpenVINO properties")
    try:
        return info.engine_class()(model_dir, compression, device=device, **info.engine_options, **options)
    except (RuntimeError, ValueError, OSError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(
            f"backend {backend} cannot load the model {model_dir} (are its files complete?): {one_line(exc)}"
        ) from exc
