"""The fast path: per-layer caches that give a method's reference results without its host work.

The references (:mod:`ov_kvcrush.methods`) are written to be read and to be the oracle: Python
loops over heads, a store concatenated every step, float32 everywhere. On a GPU that costs more
than the compression saves. A fast layer here implements the same :class:`~ov_kvcrush.methods.LayerCache`
protocol with the same semantics (tested against the reference), as device-wide tensor work with
no host synchronisation per step; :class:`~ov_kvcrush.engines.hf_cache.CompressedCache` uses it
where :func:`fast_layer` offers one (the torch engine on CUDA does by default), and the reference
everywhere else.

A method gets a fast path by declaring the ``cuda`` runtime (with the options it refuses: their
configs stay on the reference) and adding its factory to :data:`FAST_LAYERS`; a test holds the
two to each other, and ``docs/support.md`` lists them: today the full cache, ClusterKV, Quest,
MiniKV (its 2-bit store read in place by a Triton kernel) and the importance evictions
StreamingLLM, H2O, SnapKV and PyramidKV (KVCrush and Knorm select differently and stay on the
reference).
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
from ov_kvcrush.methods.runtimes import CUDA, runs


def _clusterkv(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache:
    assert isinstance(config, ClusterKVConfig)
    return FastClusterKVLayerCache(config, dense=layer_idx < config.dense_layers, reserve=reserve)


def _minikv(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache:
    assert isinstance(config, MiniKVConfig)
    return FastMiniKVLayerCache(config, layer_idx, num_layers, reserve)


def _eviction(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache:
    assert isinstance(config, EvictionConfig) and not config.selection_frozen()  # frozen: the 2-bit store's
    return FastEvictionLayerCache(config, layer_idx, num_layers)


def _quest(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache:
    assert isinstance(config, QuestConfig)
    return FastQuestLayerCache(config, dense=layer_idx < config.dense_layers, reserve=reserve)


def _full(config: MethodConfig, layer_idx: int, num_layers: int, reserve: int) -> LayerCache:
    return FastLayerCache(reserve)


#: method name -> factory of its fast layer cache, for the configs the ``cuda`` runtime runs
FAST_LAYERS: dict[str, Callable[[MethodConfig, int, int, int], LayerCache]] = {
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
    """The fast layer cache of ``config``'s method for one layer, or ``None`` where the ``cuda``
    runtime does not run ``config`` (use the reference).

    ``reserve``: tokens the layer will receive after the prompt (preallocated).
    """
    check_layer(layer_idx, num_layers)
    if not runs(config, CUDA.name):
        return None
    return FAST_LAYERS[config.name](config, layer_idx, num_layers, reserve)
