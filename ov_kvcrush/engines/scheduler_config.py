"""openvino_genai's ``SchedulerConfig`` read as ours: what a user who already passes one gets.

Users of native ``openvino_genai.LLMPipeline(..., scheduler_config=...)`` keep their code; the
openvino engine and the serving pipeline translate the native eviction settings into the
matching :class:`~ov_kvcrush.config.CompressionConfig` and the native pool size into our
block limit (the reverse of :func:`ov_kvcrush.config.to_native_scheduler_config`).
"""

from __future__ import annotations

from ov_kvcrush.config import CompressionConfig, KVCrushSettings
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.op.kvcache import DEFAULT_BLOCK_SIZE

# Imported where used, inside functions: what pulls in openvino_genai, heavy to import, so that
# importing this module stays light.


def pool_blocks_from_scheduler_config(sc, layers: int, kv_heads: int, block_bytes: int) -> int:
    """The block limit an ``openvino_genai.SchedulerConfig`` sets (0: none).

    ``num_kv_blocks`` counts native blocks (32 tokens of every layer and KV head), so it becomes
    ``num_kv_blocks × layers × kv_heads`` of ours; ``cache_size`` (GB) becomes the blocks of
    ``block_bytes`` that fit in it.
    """
    if sc.num_kv_blocks:
        return int(sc.num_kv_blocks) * layers * kv_heads
    if sc.cache_size:
        return max(1, int(sc.cache_size) * (1 << 30) // block_bytes)
    return 0


def compression_from_scheduler_config(sc) -> CompressionConfig:
    """The :class:`CompressionConfig` an ``openvino_genai.SchedulerConfig`` describes.

    Without ``use_cache_eviction``: the full cache. With it, the ``CacheEvictionConfig`` (and
    its ``KVCrushConfig``) become the matching method: a KVCrush config is KVCrush,
    ``snapkv_window_size > 0`` SnapKV, otherwise H2O; sinks, recent window, budget (KVCrush's
    share included, as :func:`~ov_kvcrush.config.to_native_scheduler_config` carves it out),
    aggregation, rotation and the KVCrush anchor are carried over.
    """
    import openvino_genai as ov_genai

    if not isinstance(sc, ov_genai.SchedulerConfig):
        raise ConfigError("scheduler_config", sc, "an openvino_genai.SchedulerConfig")
    if not sc.use_cache_eviction:
        return CompressionConfig()
    ev = sc.cache_eviction_config
    kv = ev.kvcrush_config
    kv_blocks = int(kv.budget) if kv is not None else 0
    window = int(ev.snapkv_window_size)
    method = "kvcrush" if kv_blocks else ("snapkv" if window else "h2o")
    agg = str(ev.aggregation_mode).rsplit(".", 1)[-1].lower()
    if agg not in ("sum", "norm_sum"):
        raise ConfigError("cache_eviction_config.aggregation_mode", agg, "SUM or NORM_SUM")
    anchor = str(kv.anchor_point_mode).rsplit(".", 1)[-1].lower() if kv is not None else "random"
    return CompressionConfig(
        method=method,
        budget=int(ev.get_max_cache_size()) + kv_blocks * DEFAULT_BLOCK_SIZE,
        sink_tokens=int(ev.get_start_size()),
        recent_tokens=int(ev.get_recent_size()),
        snapkv_window=window or 8,
        aggregation=agg,
        apply_rotation=bool(ev.apply_rotation),
        kvcrush=KVCrushSettings(
            budget=kv_blocks * DEFAULT_BLOCK_SIZE if kv_blocks else None,
            anchor=anchor,
            seed=int(kv.rng_seed) if kv is not None else 0,
        ),
    )
