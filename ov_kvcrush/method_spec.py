"""The method spec the C++ op runs: a reference method config flattened for ``plugins/cpu``.

The reference configs (:mod:`ov_kvcrush.methods`) stay the one place where defaults and
semantics live. This module resolves everything a config derives (per-layer pyramid budgets,
KVCrush's default representative count, its random anchors drawn with the reference's own
generator) and writes it as ``key=value;...`` for ``MethodParams::parse`` in
``plugins/cpu/src/method.cpp``, which validates it again and names any bad field.
"""

from __future__ import annotations

from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.methods import (
    ChelseaConfig,
    ClusterKVConfig,
    FullConfig,
    H2OConfig,
    KVCrushConfig,
    MethodConfig,
    MiniKVConfig,
    SnapKVConfig,
    StreamingLLMConfig,
)

#: Methods the OpenVINO op runs (every method of the registry but Quest, a recall baseline kept
#: to the torch engine).
OPENVINO_METHODS = (
    "full",
    "streamingllm",
    "h2o",
    "snapkv",
    "pyramidkv",
    "kvcrush",
    "clusterkv",
    "chelsea",
    "minikv",
)


def _anchor_bits(cfg: KVCrushConfig, q_heads: int) -> list[str]:
    """Each anchor as ``mean`` or its bit string (one bit per query head), as the reference draws it."""
    import torch

    from ov_kvcrush.methods.kvcrush import make_anchors

    out = []
    for i, mode in enumerate(cfg.anchors):
        if mode == "mean":
            out.append("mean")
            continue
        # make_anchors draws anchor i with seed + i; only its position in the tuple matters
        bits = make_anchors(torch.zeros(1, 0, q_heads, dtype=torch.bool), (mode,), cfg.seed + i)[0, 0]
        out.append("".join("1" if b else "0" for b in bits.tolist()))
    return out


def method_spec(config: MethodConfig, layers: int, q_heads: int, block_size: int) -> str:
    """The spec string of ``config`` for a model with ``layers`` layers and ``q_heads`` query heads.

    Raises :class:`~ov_kvcrush.errors.UserError` for a method (or option) the op does not run.
    """
    if isinstance(config, FullConfig):
        return ""
    if config.name not in OPENVINO_METHODS:
        raise UserError(
            f"method={config.name} does not run inside the OpenVINO op; backend openvino runs: "
            + ", ".join(OPENVINO_METHODS)
            + "; backend torch runs every method"
        )
    items: dict[str, object] = {"method": config.name}
    budgets = [config.layer_budget(i, layers) or 0 for i in range(layers)]
    items["budgets"] = ",".join(str(b) for b in budgets)
    quant = getattr(config, "quant", None)
    if quant is not None:
        # MiniKV's store under any method; the selection above it is frozen at prefill, as in the reference
        items.update(quant=1, group=quant.group_size, residual=quant.residual_tokens)
        if quant.residual_tokens % block_size or block_size % quant.group_size:
            raise ConfigError(
                "options.quant.residual_tokens",
                quant.residual_tokens,
                f"a multiple of the KV block size {block_size}, with quant.group_size dividing it (backend openvino)",
            )
    if isinstance(config, StreamingLLMConfig):
        assert config.budget is not None
        items.update(sinks=config.sink_tokens, recent=config.budget - config.sink_tokens, scoring="none")
    elif isinstance(config, H2OConfig):
        if config.head_budgets != "uniform":
            raise ConfigError("options.head_budgets", config.head_budgets, "uniform (backend openvino)")
        items.update(sinks=config.sink_tokens, recent=config.recent_tokens, scoring=config.scoring_mode())
        if isinstance(config, SnapKVConfig):
            items.update(window=config.window, pool_kernel=config.pool_kernel, pool=config.pool)
        if isinstance(config, MiniKVConfig) or getattr(config, "frozen_selection", False) or quant is not None:
            items["frozen"] = 1
        if isinstance(config, KVCrushConfig):
            items.update(
                representatives=config.n_representatives,
                signature=config.signature,
                multi_anchor=config.multi_anchor,
                representative=config.representative,
                anchors=",".join(_anchor_bits(config, q_heads)),
            )
            if config.block_size is not None:
                if quant is not None:
                    raise ConfigError("options.block_size", config.block_size, "None with quant (backend openvino)")
                if config.block_size != block_size:
                    raise ConfigError(
                        "options.block_size",
                        config.block_size,
                        f"the engine's KV block size {block_size} (backend openvino evicts whole blocks of the pool)",
                    )
                items["block_wise"] = 1
    elif isinstance(config, ClusterKVConfig):
        if config.track_recall:
            raise ConfigError("options.track_recall", True, "false (backend openvino; the torch engine tracks recall)")
        items.update(
            sinks=config.sink_tokens,
            tokens_per_cluster=config.tokens_per_cluster,
            n_clusters=config.n_clusters or 0,
            new_clusters=config.new_clusters,
            cluster_every=config.cluster_every,
            max_iters=config.max_iters,
            seed=config.seed,
            cache_steps=config.recall_cache_steps,
        )
    elif isinstance(config, ChelseaConfig):
        if quant is not None:
            raise ConfigError("options.quant", "set", "None for chelsea (backend openvino; the torch engine runs it)")
        items.update(
            sinks=config.sink_tokens,
            recent=config.recent_tokens,
            chunk=config.chunk_size,
            merge_interval=config.merge_interval,
        )
        if config.outlier_heads:
            items["outliers"] = ",".join(f"{layer},{head}" for layer, head in config.outlier_heads)
    else:  # a method listed in OPENVINO_METHODS without a mapping here
        raise UserError(f"method={config.name} is not mapped to the OpenVINO op")
    return ";".join(f"{k}={v}" for k, v in items.items())
