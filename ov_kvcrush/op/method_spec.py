"""The method spec the C++ op runs: a reference method config flattened for ``plugins/cpu``.

The reference configs (:mod:`ov_kvcrush.methods`) stay the one place where defaults and
semantics live. Each config that declares the ``openvino`` engine builds its own fields
(:meth:`~ov_kvcrush.methods.MethodConfig.op_fields`: everything derived already resolved, e.g.
KVCrush's default representative count and its random anchors drawn with the reference's own
generator); this module adds what every policy shares (the method's name, its per-layer budgets,
the 2-bit store) and writes ``key=value;...`` for the op's policy table
(``plugins/cpu/src/policy.cpp``). The op has no defaults: its policy reads exactly these keys,
validates each again, and names a missing, unknown or bad one.
"""

from __future__ import annotations

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import MethodConfig, require
from ov_kvcrush.methods.runtimes import CPU_OP


def store_fields(config: MethodConfig, block_size: int) -> dict[str, object]:
    """The KV store's fields: full precision, or MiniKV's 2-bit blocks (``quant`` under any method)."""
    quant = config.store_settings()
    if quant is None:
        return {"quant": 0}
    if quant.residual_tokens % block_size or block_size % quant.group_size:
        raise ConfigError(
            "options.quant.residual_tokens",
            quant.residual_tokens,
            f"a multiple of the KV block size {block_size}, with quant.group_size dividing it (backend openvino)",
        )
    tail = quant.pinned_tail(selecting=config.pins_prompt_tail)
    return {
        "quant": 1,
        "group": quant.group_size,
        "residual": quant.residual_tokens,
        "tail": tail,
        "key_bits": quant.kbits,
        "value_bits": quant.vbits,
    }


def method_spec(
    config: MethodConfig, layers: int, q_heads: int, block_size: int, windows: list[int] | None = None
) -> str:
    """The spec string of ``config`` for a model with ``layers`` layers and ``q_heads`` query heads.

    ``windows`` (per layer, a sliding-window span or 0): the method is laid over the global
    layers only, as the torch engine does: its per-layer budgets (pyramids, dense layers) are
    those of the n-th global layer of n global layers; a local layer gets none (the op keeps
    its window).

    Raises :class:`~ov_kvcrush.errors.ConfigError` for a method (or option) the op does not run
    (its declaration of the ``cpu-op`` runtime), naming where it runs.
    """
    require(config, CPU_OP.name)
    global_layers = [i for i in range(layers) if not (windows and windows[i])]
    budgets = [0] * layers
    for g, i in enumerate(global_layers):
        budgets[i] = config.layer_budget(g, len(global_layers)) or 0
    items: dict[str, object] = {
        "method": config.name,
        "budgets": ",".join(str(b) for b in budgets),
        **store_fields(config, block_size),
        **config.op_fields(layers, q_heads, block_size),
    }
    return ";".join(f"{k}={v}" for k, v in items.items())
