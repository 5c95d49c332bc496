"""Which methods the GPU path's device pool serves, and their layer caches: the registry
``TorchEngine(paged_device="opencl")`` builds each layer's cache from (and refuses a method it
does not serve by, naming the ones it does)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.gpu.layer_cache import (
    DeviceFullLayerCache,
    DeviceH2OLayerCache,
    DeviceKnormLayerCache,
    DeviceKVCrushLayerCache,
    DeviceSnapKVLayerCache,
    DeviceStreamingLLMLayerCache,
)
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.quant_cache import DeviceQuantEvictionLayerCache, DeviceQuantKVCrushLayerCache
from ov_kvcrush.gpu.quest_cache import DeviceQuestLayerCache
from ov_kvcrush.gpu.recall_cache import DeviceClusterKVLayerCache
from ov_kvcrush.methods import LayerCache, MethodConfig
from ov_kvcrush.methods.clusterkv import ClusterKVConfig
from ov_kvcrush.methods.importance import EvictionConfig, H2OConfig, SnapKVConfig, StreamingLLMConfig
from ov_kvcrush.methods.knorm import KnormConfig
from ov_kvcrush.methods.kvcrush import KVCrushConfig
from ov_kvcrush.methods.quest import QuestConfig


def _always(config: MethodConfig) -> bool:
    return True


def _uniform_single_tokens(config: MethodConfig) -> bool:
    """An importance config this path serves: uniform head budgets (per layer: PyramidKV's and
    MiniKV's pyramids), single tokens, over the full-precision or the 2-bit store (adaptive
    budgets and spans stay on the reference)."""
    assert isinstance(config, H2OConfig)
    return config.head_budget_mode() == "uniform" and config.span_tokens() is None


def _full(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    return DeviceFullLayerCache(pool, kv, hq)


def _importance(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, H2OConfig)
    if config.quant is not None:
        return DeviceQuantEvictionLayerCache(config, pool, kv, hq, config.layer_budget(layer, layers))
    kind = DeviceSnapKVLayerCache if isinstance(config, SnapKVConfig) else DeviceH2OLayerCache
    return kind(config, pool, kv, hq, config.layer_budget(layer, layers))


def _full_precision(config: MethodConfig) -> bool:
    """The full-precision store (StreamingLLM's and Knorm's 2-bit store stays on the reference)."""
    assert isinstance(config, EvictionConfig)
    return config.quant is None


def _streamingllm(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, StreamingLLMConfig) and config.budget is not None
    return DeviceStreamingLLMLayerCache(config, pool, kv, hq, config.budget)


def _knorm(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, KnormConfig) and config.budget is not None
    return DeviceKnormLayerCache(config, pool, kv, hq, config.budget)


def _kvcrush(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, KVCrushConfig)
    kind = DeviceKVCrushLayerCache if config.quant is None else DeviceQuantKVCrushLayerCache
    return kind(config, pool, kv, hq, config.layer_budget(layer, layers))


def _clusterkv_served(config: MethodConfig) -> bool:
    """The full-precision store, without the evaluation's recall tracking."""
    assert isinstance(config, ClusterKVConfig)
    return config.quant is None and not config.track_recall


def _clusterkv(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, ClusterKVConfig)
    return DeviceClusterKVLayerCache(config, pool, kv, hq, dense=layer < config.dense_layers)


def _quest_served(config: MethodConfig) -> bool:
    """Without the evaluation's recall tracking."""
    assert isinstance(config, QuestConfig)
    return not config.track_recall


def _quest(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, QuestConfig)
    return DeviceQuestLayerCache(config, pool, kv, hq, dense=layer < config.dense_layers)


@dataclass(frozen=True)
class DeviceLayerKind:
    """Which configs of a method this path serves, and how its layer cache is built."""

    served: Callable[[MethodConfig], bool]
    build: Callable[[MethodConfig, int, int, DevicePool, int, int], LayerCache]


#: method name -> its device layer cache
DEVICE_LAYERS: dict[str, DeviceLayerKind] = {
    "full": DeviceLayerKind(_always, _full),
    "h2o": DeviceLayerKind(_uniform_single_tokens, _importance),
    "snapkv": DeviceLayerKind(_uniform_single_tokens, _importance),
    "pyramidkv": DeviceLayerKind(_uniform_single_tokens, _importance),
    "minikv": DeviceLayerKind(_uniform_single_tokens, _importance),
    "kvcrush": DeviceLayerKind(_always, _kvcrush),
    "clusterkv": DeviceLayerKind(_clusterkv_served, _clusterkv),
    "streamingllm": DeviceLayerKind(_full_precision, _streamingllm),
    "knorm": DeviceLayerKind(_full_precision, _knorm),
    "quest": DeviceLayerKind(_quest_served, _quest),
}


def check_served(config: MethodConfig) -> None:
    """A ``ConfigError`` naming what this path serves, unless it serves ``config``."""
    kind = DEVICE_LAYERS.get(config.name)
    if kind is None or not kind.served(config):
        raise ConfigError(
            "method",
            config.name,
            ", ".join(DEVICE_LAYERS)
            + " (the GPU path, paged_device: uniform head budgets, single tokens or KVCrush's blocks; StreamingLLM's, "
            "Knorm's and ClusterKV's full-precision store; ClusterKV and Quest without recall tracking)",
        )


def device_layer(
    config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv_heads: int, q_heads: int
) -> LayerCache:
    """The device layer cache of ``config``'s method for one layer (:func:`check_served` first)."""
    check_served(config)
    return DEVICE_LAYERS[config.name].build(config, layer, layers, pool, kv_heads, q_heads)
