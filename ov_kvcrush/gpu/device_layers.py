"""The GPU path's device pool's layer caches, by method: what ``TorchEngine(paged_device=...)``
builds each layer's cache from (:data:`DEVICE_LAYERS`), and what the GPU plugin's sequences build
theirs from (:data:`PLUGIN_LAYERS`: those, and the layers only the plugin's model steps drive).
Which configs each runs is each method's declaration (the ``gpu-pool`` and ``gpu-plugin``
runtimes, :mod:`ov_kvcrush.methods.runtimes`); a method it does not run, or an option it
refuses, is refused through :func:`~ov_kvcrush.methods.require`."""

from __future__ import annotations

from collections.abc import Callable

from ov_kvcrush.gpu.chelsea_cache import DeviceChelseaLayerCache
from ov_kvcrush.gpu.importance_cache import DeviceH2OLayerCache, DeviceKnormLayerCache, DeviceSnapKVLayerCache
from ov_kvcrush.gpu.kvcrush_cache import DeviceKVCrushLayerCache
from ov_kvcrush.gpu.kvzip_cache import DeviceKVzipLayerCache
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.quant_cache import DeviceQuantEvictionLayerCache, DeviceQuantKVCrushLayerCache
from ov_kvcrush.gpu.quest_cache import DeviceQuestLayerCache
from ov_kvcrush.gpu.recall_cache import DeviceClusterKVLayerCache, DeviceRecallLayerCache
from ov_kvcrush.gpu.streaming_cache import DeviceStreamingLLMLayerCache
from ov_kvcrush.methods import LayerCache, MethodConfig, require
from ov_kvcrush.methods.chelsea import ChelseaConfig
from ov_kvcrush.methods.clusterkv import ClusterKVConfig
from ov_kvcrush.methods.importance import H2OConfig, SnapKVConfig, StreamingLLMConfig
from ov_kvcrush.methods.knorm import KnormConfig
from ov_kvcrush.methods.kvcrush import KVCrushConfig
from ov_kvcrush.methods.kvzip import KVzipConfig
from ov_kvcrush.methods.quest import QuestConfig
from ov_kvcrush.methods.runtimes import GPU_PLUGIN, GPU_POOL


def _full(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    return DeviceFullLayerCache(pool, kv, hq)


def _importance(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, H2OConfig)
    if config.quant is not None:
        return DeviceQuantEvictionLayerCache(config, pool, kv, hq, config.layer_budget(layer, layers))
    kind = DeviceSnapKVLayerCache if isinstance(config, SnapKVConfig) else DeviceH2OLayerCache
    return kind(config, pool, kv, hq, config.layer_budget(layer, layers))


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


def _clusterkv(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, ClusterKVConfig)
    return DeviceClusterKVLayerCache(config, pool, kv, hq, dense=layer < config.dense_layers)


def _quest(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, QuestConfig)
    return DeviceQuestLayerCache(config, pool, kv, hq, dense=layer < config.dense_layers)


def _kvzip(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, KVzipConfig)
    return DeviceKVzipLayerCache(config, pool, kv, hq)


def _chelsea(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, ChelseaConfig)
    return DeviceChelseaLayerCache(config, pool, kv, hq, config.layer_outliers(layer), layers)


#: method name -> how its device layer cache is built, for the configs the ``gpu-pool`` runtime runs
DEVICE_LAYERS: dict[str, Callable[[MethodConfig, int, int, DevicePool, int, int], LayerCache]] = {
    "full": _full,
    "h2o": _importance,
    "snapkv": _importance,
    "pyramidkv": _importance,
    "minikv": _importance,
    "kvcrush": _kvcrush,
    "clusterkv": _clusterkv,
    "streamingllm": _streamingllm,
    "knorm": _knorm,
    "quest": _quest,
}


#: the same for the ``gpu-plugin`` runtime: the pool's, KVzip's, whose scoring pass is the
#: model's steps (the plugin's), and Chelsea's, whose decode merge is a layer of the model
PLUGIN_LAYERS: dict[str, Callable[[MethodConfig, int, int, DevicePool, int, int], LayerCache]] = {
    **DEVICE_LAYERS,
    "kvzip": _kvzip,
    "chelsea": _chelsea,
}


#: the methods whose decode step attends a list of slots its query recalls, by their layer cache
#: (whose ``recall_layer`` is the layer of the GPU plugin's model that recalls)
RECALLING: dict[str, type[DeviceRecallLayerCache]] = {
    "clusterkv": DeviceClusterKVLayerCache,
    "quest": DeviceQuestLayerCache,
}


def model_recall_layer(config: MethodConfig) -> str | None:
    """The layer of the GPU plugin's model that recalls for ``config``'s method; None for a method
    whose decode attends every slot it holds."""
    kind = RECALLING.get(config.name)
    return kind.recall_layer if kind else None


#: the methods whose decode step merges in the GPU plugin's model (its merge layer) before it attends
MERGING = {"chelsea": DeviceChelseaLayerCache}


def model_merges(config: MethodConfig) -> bool:
    """Whether the GPU plugin's model merges for ``config``'s method (Chelsea's merge layer)."""
    return config.name in MERGING


def device_layer(
    config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv_heads: int, q_heads: int
) -> LayerCache:
    """The device layer cache of ``config``'s method for one layer (refused unless the ``gpu-pool``
    runtime runs ``config``)."""
    require(config, GPU_POOL.name)
    return DEVICE_LAYERS[config.name](config, layer, layers, pool, kv_heads, q_heads)


def plugin_layer(
    config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv_heads: int, q_heads: int
) -> LayerCache:
    """The layer cache of ``config``'s method for one layer of a GPU plugin's sequence (refused
    unless the ``gpu-plugin`` runtime runs ``config``)."""
    require(config, GPU_PLUGIN.name)
    return PLUGIN_LAYERS[config.name](config, layer, layers, pool, kv_heads, q_heads)
