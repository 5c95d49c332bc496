"""The fast path: per-layer caches that give a method's reference results without its host work.

The references (:mod:`ov_kvcrush.methods`) are written to be read and to be the oracle: Python
loops over heads, a store concatenated every step, float32 everywhere. On a GPU that costs more
than the compression saves. A fast layer here implements the same :class:`~ov_kvcrush.methods.LayerCache`
protocol with the same semantics (tested against the reference), as device-wide tensor work with
no host synchronisation per step; :class:`~ov_kvcrush.engines.hf_cache.CompressedCache` uses it
where :func:`fast_layer` offers one (the torch engine on CUDA does by default), and the reference
everywhere else.

A method gets a fast path by adding its factory to :data:`FAST_LAYERS`: today the full cache,
ClusterKV (without the 2-bit store and without recall tracking, which stay on the reference),
Quest (without recall tracking),
MiniKV (its 2-bit store read in place by a Triton kernel) and the importance evictions
StreamingLLM, H2O, SnapKV and PyramidKV (uniform head budgets; KVCrush and Knorm select
differently and stay on the reference).
Their single-token decode steps can be captured and replayed as CUDA graphs
(:mod:`ov_kvcrush.fastpath.dense` says what that asks of a layer). The prefill of every
method is fast already: its attention goes through :mod:`ov_kvcrush.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable

from ov_kvcrush.fastpath.clusterkv import FastClusterKVLayerCache
from ov_kvcrush.fastpath.dense import FastLayerCache
from ov_kvcrush.fastpath.eviction import FastEvictionLayerCache
from ov_kvcrush.fastpath.minikv import FastMiniKVLayerCache
from ov_kvcrush.fastpath.quest import FastQuestLayerCache
from ov_kvcrush.methods import ClusterKVConfig, LayerCache, MethodConfig, MiniKVConfig, QuestConfig
from ov_kvcrush.methods.base import check_layer
from ov_kvcrush.methods.importance import EvictionConfig


def _clusterkv(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache | None:
    assert isinstance(config, ClusterKVConfig)
    if config.quant is not None or config.track_recall:
        return None
    return FastClusterKVLayerCache(config, dense=layer_idx < config.dense_layers, reserve=reserve)


def _minikv(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache | None:
    assert isinstance(config, MiniKVConfig)
    if config.quant is None or config.head_budget_mode() != "uniform" or config.span_tokens():
        return None  # span selection stays on the reference
    return FastMiniKVLayerCache(config, layer_idx, num_layers, reserve)


def _eviction(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache | None:
    assert isinstance(config, EvictionConfig)
    if (
        config.quant is not None
        or config.selection_frozen()
        or config.head_budget_mode() != "uniform"
        or config.span_tokens()
    ):
        return None  # the quantized store, frozen selections, adaptive head budgets and spans stay on the reference
    return FastEvictionLayerCache(config, layer_idx, num_layers)


def _quest(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache | None:
    assert isinstance(config, QuestConfig)
    if config.track_recall:
        return None
    return FastQuestLayerCache(config, dense=layer_idx < config.dense_layers, reserve=reserve)


def _full(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache | None:
    return FastLayerCache(reserve)


#: method name -> factory of its fast layer cache (``None`` where that config needs the reference).
FAST_LAYERS: dict[str, Callable[[MethodConfig, int, int, int], LayerCache | None]] = {
    "full": _full,
    "clusterkv": _clusterkv,
    "minikv": _minikv,
    "quest": _quest,
    "streamingllm": _eviction,
    "h2o": _eviction,
    "snapkv": _eviction,
    "pyramidkv": _eviction,
}


def fast_layer(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int = 0) -> LayerCache | None:
    """The fast layer cache of ``config``'s method for one layer, or ``None`` (use the reference).

    ``reserve``: tokens the layer will receive after the prompt (preallocated).
    """
    check_layer(layer_idx, num_layers)
    factory = FAST_LAYERS.get(config.name)
    return None if factory is None else factory(config, layer_idx, num_layers, reserve)
