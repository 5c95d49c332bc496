"""Config validation: every bad field is refused with its name and allowed range."""

from __future__ import annotations

import pytest

from ov_kvcrush.config import (
    CompressionConfig,
    GenerationSettings,
    KVCrushSettings,
    check_native,
    native_kvcrush_budget,
    to_native_scheduler_config,
)
from ov_kvcrush.errors import ConfigError

BAD_COMPRESSION = [
    ({"method": "bogus"}, "method", "one of full, streamingllm"),
    ({"method": "snapkv", "budget": None}, "budget", "an integer in [1,"),
    # the reference SnapKV's own floor: its default sinks (16) + recent window (64)
    ({"method": "snapkv", "budget": 60}, "budget", "an integer in [80,"),
    ({"method": "snapkv", "budget": 200, "sink_tokens": 100, "recent_tokens": 150}, "budget", "[250,"),
    ({"method": "kvcrush", "budget": 256, "options": {"representatives": 500}}, "representatives", "[0,"),
    ({"method": "clusterkv", "budget": 256, "options": {"bogus": 1}}, "bogus", "a field of clusterkv"),
    ({"method": "clusterkv", "budget": 256, "options": {"budget": 1}}, "options.budget", "CompressionConfig.budget"),
    ({"method": "full", "options": {"quant": True}}, "options", "unset for method full"),
    ({"method": "h2o", "budget": 256, "options": [("quant", True)]}, "options", "a mapping"),
    ({"method": "snapkv", "budget": 2**21}, "budget", "1048576]"),
    ({"method": "snapkv", "budget": 256.0}, "budget", "an integer"),
    ({"method": "full", "budget": 0}, "budget", "[1,"),
    ({"sink_tokens": -1}, "sink_tokens", "[0,"),
    ({"recent_tokens": 0}, "recent_tokens", "[1,"),
    ({"snapkv_window": 0}, "snapkv_window", "[1, 4096]"),
    ({"aggregation": "adaptive_rkv"}, "aggregation", "one of sum, norm_sum"),
    ({"apply_rotation": "yes"}, "apply_rotation", "true or false"),
    ({"kvcrush": {"budget": 3}}, "kvcrush", "a KVCrushSettings"),
]


@pytest.mark.parametrize(("kwargs", "field", "allowed"), BAD_COMPRESSION)
def test_compression_config_names_field_and_range(kwargs, field, allowed):
    with pytest.raises(ConfigError) as info:
        CompressionConfig(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    assert allowed in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"budget": -1}, "kvcrush.budget", "[0,"),
        ({"anchor": "middle"}, "kvcrush.anchor", "random, zeros, ones, mean, alternating"),
        ({"seed": -5}, "kvcrush.seed", "[0, 2147483647]"),
    ],
)
def test_kvcrush_settings_names_field(kwargs, field, allowed):
    with pytest.raises(ConfigError) as info:
        KVCrushSettings(**kwargs)
    assert info.value.field == field and allowed in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens", "[1, 65536]"),
        ({"do_sample": 1}, "do_sample", "true or false"),
        ({"temperature": 0.0}, "temperature", "(0.0, 100.0]"),
        ({"top_p": 1.5}, "top_p", "(0.0, 1.0]"),
        ({"top_k": -1}, "top_k", "[0,"),
        ({"seed": 2**31}, "seed", "[0, 2147483647]"),
    ],
)
def test_generation_settings_names_field(kwargs, field, allowed):
    with pytest.raises(ConfigError) as info:
        GenerationSettings(**kwargs)
    assert info.value.field == field and allowed in str(info.value)


def test_defaults_are_valid_and_full_needs_no_budget():
    assert not CompressionConfig().compresses
    assert CompressionConfig(method="kvcrush", budget=512).compresses
    GenerationSettings()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": "snapkv", "budget": 300}, "budget"),  # not a multiple of 32
        ({"method": "snapkv", "budget": 512, "sink_tokens": 20}, "sink_tokens"),
        ({"method": "kvcrush", "budget": 512, "kvcrush": KVCrushSettings(budget=40)}, "kvcrush.budget"),
        ({"method": "kvcrush", "budget": 256, "kvcrush": KVCrushSettings(budget=96)}, "kvcrush.budget"),
        ({"method": "snapkv", "budget": 128}, "budget"),  # not above the native sinks + recent (160)
        ({"method": "chelsea", "budget": 256}, "method"),  # not a native method
        ({"method": "h2o", "budget": 256, "options": {"quant": True}}, "options"),
    ],
)
def test_native_block_constraints(kwargs, field):
    with pytest.raises(ConfigError) as info:
        check_native(CompressionConfig(**kwargs), 32)
    assert info.value.field == field and "backend genai" in str(info.value)


def test_native_mapping_carves_kvcrush_out_of_the_total():
    cfg = CompressionConfig(method="kvcrush", budget=512, kvcrush=KVCrushSettings(budget=64, anchor="mean", seed=3))
    sc = to_native_scheduler_config(cfg)
    ev = sc.cache_eviction_config
    assert sc.use_cache_eviction and not sc.enable_prefix_caching
    assert ev.get_max_cache_size() + ev.kvcrush_config.budget * 32 == 512
    assert ev.kvcrush_config.budget == 2 and ev.kvcrush_config.rng_seed == 3
    assert str(ev.kvcrush_config.anchor_point_mode).endswith("MEAN")
    assert ev.get_start_size() == 32 and ev.get_recent_size() == 128
    # default share: a quarter of the evictable area, in whole blocks
    assert native_kvcrush_budget(CompressionConfig(method="kvcrush", budget=512), 32) == 64


def test_native_mapping_full_and_h2o():
    assert not to_native_scheduler_config(CompressionConfig()).use_cache_eviction
    ev = to_native_scheduler_config(CompressionConfig(method="h2o", budget=256)).cache_eviction_config
    assert ev.snapkv_window_size == 0 and ev.get_max_cache_size() == 256
    ev = to_native_scheduler_config(
        CompressionConfig(method="snapkv", budget=256, snapkv_window=16)
    ).cache_eviction_config
    assert ev.snapkv_window_size == 16


def test_every_registered_method_is_a_compression_config_and_builds_its_reference():
    from ov_kvcrush.methods import REGISTRY

    for name, cls in REGISTRY.items():
        cfg = CompressionConfig(method=name, budget=256 if cls.needs_budget else None)
        ref = cfg.method_config()
        assert type(ref) is cls and getattr(ref, "budget", 256) == 256


def test_options_and_sinks_reach_the_reference_config():
    cfg = CompressionConfig(
        method="kvcrush", budget=300, sink_tokens=8, recent_tokens=32, options={"representatives": 40, "quant": True}
    )
    ref = cfg.method_config()
    assert (ref.sink_tokens, ref.recent_tokens, ref.representatives) == (8, 32, 40)
    assert ref.quant is not None and ref.quant.bits == 2
    # sinks/recent left unset: the method's own defaults, not the native ones
    assert CompressionConfig(method="h2o", budget=256).method_config().sink_tokens == 16
    assert CompressionConfig(method="h2o", budget=256).native_sink_tokens == 32
