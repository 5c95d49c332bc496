"""The methods' layer caches with their KV on the GPU path's device: a real decode through the
OpenCL kernels.

Each class here is a :class:`~ov_kvcrush.methods.LayerCache` (the protocol the torch engine's
:class:`~ov_kvcrush.engines.hf_cache.CompressedCache` drives) whose tokens live in a
:class:`~ov_kvcrush.gpu.pool.DevicePool` and whose steps run as kernels: the step's keys and
values are stored in place (``paged_store.cl``), the prompt and decode attention read the pool
(``prefill.cl``, ``paged_attention.cl``), an importance method's scores stay on the device (the
window's column sums, pooled per query head, then each decode step's probabilities added:
``snapkv.cl``), its selection runs there (``pooled_group_scores`` then ``kvcrush.cl``'s rank
rule) and eviction gathers the kept slots into fresh blocks. The policy is the reference's
(:mod:`ov_kvcrush.methods.importance`): when to select, how many to keep, sinks and recent
tokens; what crosses to the host per step is the step's queries, keys, values and output (the
model runs on the host here), the block tables when they change, and one byte per middle token
and KV head when a selection runs. :attr:`DevicePool.crossings` counts it.

Served: the full cache, H2O and SnapKV (uniform budgets, single tokens, full-precision store),
one sequence at a time. The other methods keep their reference caches and the engine refuses
them on this path, naming the ones it serves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.gpu.pool import DevicePool, PagedLayer
from ov_kvcrush.gpu.snapkv import kept_tokens, launch_keep
from ov_kvcrush.methods import LayerCache, MethodConfig
from ov_kvcrush.methods.importance import H2OConfig, SnapKVConfig


def _host(x: torch.Tensor) -> np.ndarray:
    """One sequence's ``[1, heads, t, D]`` tensor as float32 ``[heads, t, D]``."""
    if x.shape[0] != 1:
        raise ConfigError("batch", x.shape[0], "1 (the GPU path's caches hold one sequence each)")
    return x[0].detach().to(torch.float32).cpu().numpy()


class DeviceFullLayerCache(LayerCache):
    """Every token, attended in place on the device."""

    def __init__(self, pool: DevicePool, kv_heads: int, q_heads: int) -> None:
        super().__init__()
        self.layer = PagedLayer(pool, kv_heads, q_heads)
        self._window_scores: Any = None  # device [Hq, held]: the last prompt step's window sums

    def _scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def _step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int) -> torch.Tensor:
        """Store the step's tokens, then attend its rows (the last ``window`` rows' probabilities
        summed per slot on the device, for the subclasses' scores)."""
        first = self.seen - keys.shape[2]
        self.layer.append(_host(keys), _host(values), first)
        q = _host(queries)
        scale = self._scale(q.shape[2])
        if q.shape[1] == 1 and not window:
            out = self.layer.attend_decode(q[:, 0], scale)[0][:, None]
        else:
            out, self._window_scores = self.layer.attend_prompt(q, first, scale, window)
        return torch.from_numpy(out)[None].to(queries.dtype)

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._start_prefill(queries, keys, values)
        return self._step(queries, keys, values, 0)

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._positions(keys.shape[2], keys.device)
        self.layer.pool.phase = "decode"
        return self._step(queries, keys, values, 0)

    def tokens_held(self) -> torch.Tensor:
        return torch.full((1, self.layer.kv_heads), self.layer.held)

    def memory(self) -> dict[str, int]:
        kv = self.layer.kv_bytes()
        meta = self.layer.positions.nbytes + self._metadata_bytes()
        return {"kv": kv, "metadata": meta, "total": kv + meta}

    def _metadata_bytes(self) -> int:
        """Device bytes beside the blocks (the importance methods' scores)."""
        return 0

    def release(self) -> None:
        """Give the layer's blocks back to the pool."""
        self.layer.release()


class DeviceH2OLayerCache(DeviceFullLayerCache):
    """H2O over the device pool: every prompt row's probabilities scored, ``budget`` tokens kept
    per KV head (sinks and recent ones always), each decode step's probabilities added and the
    lowest dropped once a head holds more (:class:`~ov_kvcrush.methods.importance.ImportanceLayerCache`'s steps)."""

    def __init__(self, config: H2OConfig, pool: DevicePool, kv_heads: int, q_heads: int, budget: int) -> None:
        super().__init__(pool, kv_heads, q_heads)
        self.config = config
        self.budget = budget
        self.scores: Any = None  # device [Hq, stride] float32: each held slot's accumulated score
        self.stride = 0

    def _metadata_bytes(self) -> int:
        return 4 * self.layer.q_heads * self.stride

    def prompt_scoring(self, tokens: int) -> tuple[int, int, str]:
        """The prompt's rows that score it, and how their sums are pooled: ``(window, width, pool)``.
        H2O's: every row, unpooled."""
        return tokens, 1, "max"

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._start_prefill(queries, keys, values)
        t = keys.shape[2]
        window, width, pool = self.prompt_scoring(t)
        out = self._step(queries, keys, values, window)
        self.scores, self.stride = self._pooled(self._window_scores, t, width, pool), t
        if t > self.budget:
            self._evict(width=1)
        return out

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        t = keys.shape[2]
        self._positions(t, keys.device)
        self.layer.pool.phase = "decode"
        before = self.layer.held
        if before + t > self.stride:
            self._grow(before + t)
        if t == 1:
            out = self._decode_token(queries, keys, values)
        else:  # several tokens (a chat turn): every row's probabilities
            out = self._step(queries, keys, values, t)
            self._add(self._window_scores, self.layer.held, before)
        if self.layer.held > self.budget:
            self._evict(width=1)
        return out

    def _decode_token(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.layer.append(_host(keys), _host(values), self.seen - 1)
        q = _host(queries)
        out, probs, stride = self.layer.attend_decode(q[:, 0], self._scale(q.shape[2]))
        self._add(probs, stride, self.layer.held - 1)
        return torch.from_numpy(out)[None, :, None].to(queries.dtype)

    # ---- the scores, on the device
    def _kernel(self, name: str) -> Any:
        return self.layer.pool.dev.kernel("snapkv.cl", name, {})

    def _pooled(self, sums: Any, n: int, width: int, pool: str) -> Any:
        dev = self.layer.pool.dev
        if width == 1:
            return sums
        out = dev.empty(4 * self.layer.q_heads * n)
        i32 = np.int32
        dev.run(self._kernel("pool_rows"), (n, self.layer.q_heads), None, sums, i32(n), i32(n), i32(width),
                i32(pool == "avg"), out)  # fmt: skip
        return out

    def _add(self, probs: Any, prob_stride: int, before: int) -> None:
        i32 = np.int32
        held = self.layer.held
        self.layer.pool.dev.run(self._kernel("add_step_scores"), (held, self.layer.q_heads), None, self.scores,
                                i32(self.stride), i32(before), i32(held), probs, i32(prob_stride))  # fmt: skip

    def _gather_scores(self, kept: Any, count: int, stride: int) -> Any:
        """The scores of each KV head's slots ``kept`` (device ``[kv, count]``) in a new buffer of
        row stride ``stride``."""
        dev, lay = self.layer.pool.dev, self.layer
        out = dev.zeros(4 * lay.q_heads * stride)
        i32 = np.int32
        dev.run(self._kernel("gather_rows"), (max(count, 1), lay.q_heads), None, self.scores, i32(self.stride),
                kept, i32(count), i32(count), i32(lay.q_heads // lay.kv_heads), out, i32(stride))  # fmt: skip
        return out

    def _grow(self, need: int) -> None:
        """Room for ``need`` slots' scores (the held ones copied over)."""
        lay = self.layer
        held = lay.held
        stride = max(need, self.budget + 1, 2 * self.stride)
        every = np.ascontiguousarray(np.broadcast_to(np.arange(held, dtype=np.int32), (lay.kv_heads, held)))
        self.scores = self._gather_scores(lay.pool.upload("held slots", every), held, stride)
        self.stride = stride

    def _evict(self, width: int) -> None:
        """Keep each KV head's sinks, recent tokens and top summed scores (``budget`` in all): the
        decisions come to the host, the kept slots are listed on both sides from them."""
        lay, cfg = self.layer, self.config
        dev, n, kv = lay.pool.dev, lay.held, lay.kv_heads
        sinks, recent = cfg.sink_tokens, cfg.recent_tokens
        decisions_b, mid = launch_keep(dev, self.scores, self.stride, n, lay.q_heads // kv, kv, self.budget, sinks,
                                       recent, width)  # fmt: skip
        decisions = lay.pool.download("selection decisions", decisions_b, np.uint8, (kv, mid))
        kept = np.stack(kept_tokens(decisions, n, sinks, recent))
        kept_b = dev.empty(4 * kept.size)
        i32 = np.int32
        dev.run(self._kernel("kept_slots"), (kv,), None, decisions_b, i32(mid), i32(sinks), i32(recent), i32(n),
                kept_b, i32(kept.shape[1]))  # fmt: skip
        self.scores = self._gather_scores(kept_b, kept.shape[1], self.stride)
        lay.keep(kept, kept_b)
        self._bump("evicted", float((n - kept.shape[1]) * kv))


class DeviceSnapKVLayerCache(DeviceH2OLayerCache):
    """SnapKV over the device pool: the prompt scored by its last ``window`` rows, pooled along
    tokens per query head; the rest is H2O's."""

    config: SnapKVConfig

    def prompt_scoring(self, tokens: int) -> tuple[int, int, str]:
        return min(self.config.window, tokens), self.config.pool_width, self.config.pool


def _always(config: MethodConfig) -> bool:
    return True


def _uniform_single_tokens(config: MethodConfig) -> bool:
    """An importance config this path serves: full-precision store, uniform head budgets, single
    tokens (the 2-bit store, adaptive budgets and spans stay on the reference)."""
    assert isinstance(config, H2OConfig)
    return config.quant is None and config.head_budget_mode() == "uniform" and config.span_tokens() is None


def _full(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    return DeviceFullLayerCache(pool, kv, hq)


def _importance(config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv: int, hq: int) -> LayerCache:
    assert isinstance(config, H2OConfig)
    kind = DeviceSnapKVLayerCache if isinstance(config, SnapKVConfig) else DeviceH2OLayerCache
    return kind(config, pool, kv, hq, config.layer_budget(layer, layers))


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
}


def check_served(config: MethodConfig) -> None:
    """A ``ConfigError`` naming what this path serves, unless it serves ``config``."""
    kind = DEVICE_LAYERS.get(config.name)
    if kind is None or not kind.served(config):
        raise ConfigError(
            "method",
            config.name,
            ", ".join(DEVICE_LAYERS) + " (paged_device='opencl': uniform budgets, single tokens, no 2-bit store)",
        )


def device_layer(
    config: MethodConfig, layer: int, layers: int, pool: DevicePool, kv_heads: int, q_heads: int
) -> LayerCache:
    """The device layer cache of ``config``'s method for one layer (:func:`check_served` first)."""
    check_served(config)
    return DEVICE_LAYERS[config.name].build(config, layer, layers, pool, kv_heads, q_heads)
