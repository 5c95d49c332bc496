"""Reference implementations of every KV-cache method, in torch (CPU or CUDA).

Each method is one module: a small frozen config dataclass (documented defaults, validated) plus
its algorithm, written as pure functions and a per-layer cache (:class:`LayerCache`) that the
engines drive. These define the semantics every fast path (the C++ OpenVINO op, CUDA) is tested
against.

``REGISTRY`` maps the method names used everywhere (configs, CLI flags, reports) to their config
classes; adding a method costs one module, one test file and one line here.
"""

from __future__ import annotations

from typing import Any

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import AttentionOutput, ShapeError, attend
from ov_kvcrush.methods.base import LayerCache, MethodConfig, QuantSettings
from ov_kvcrush.methods.chelsea import ChelseaConfig
from ov_kvcrush.methods.clusterkv import ClusterKVConfig
from ov_kvcrush.methods.full import FullConfig
from ov_kvcrush.methods.importance import H2OConfig, PyramidKVConfig, SnapKVConfig, StreamingLLMConfig
from ov_kvcrush.methods.kvcrush import KVCrushConfig
from ov_kvcrush.methods.minikv import MiniKVConfig
from ov_kvcrush.methods.quest import QuestConfig

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
}


def method_config(name: str, **fields: Any) -> MethodConfig:
    """Build the config of method ``name`` from keyword fields (``quant=True`` means default 2-bit settings).

    Raises :class:`~ov_kvcrush.errors.ConfigError` for an unknown method or field.
    """
    if name not in REGISTRY:
        raise ConfigError("method", name, "one of " + ", ".join(REGISTRY))
    cls = REGISTRY[name]
    if fields.get("quant") is True:
        fields["quant"] = QuantSettings()
    known = set(cls.__dataclass_fields__) - {"anchors"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(unknown[0], fields[unknown[0]], f"a field of {name}: " + ", ".join(sorted(known)))
    return cls(**fields)


__all__ = [
    "REGISTRY",
    "AttentionOutput",
    "ChelseaConfig",
    "ClusterKVConfig",
    "FullConfig",
    "H2OConfig",
    "KVCrushConfig",
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
]
