"""The openvino backend's KV cache on an Intel GPU: the pool shared with OpenVINO's GPU plugin,
each sequence's layer caches over it, and what a step feeds the model and does after it.

The model (our layers in the plugin, :mod:`ov_kvcrush.engines.gpu_plugin_model`) stores each step's keys
and values in the pool and attends them; the pool is our own OpenCL buffer
(:class:`~ov_kvcrush.gpu.pool.DevicePool`), handed to the plugin as a remote tensor of a context
made over our OpenCL context and queue, so the methods' kernels and the model's layers work on
one copy of the blocks, in order, with nothing copied between them. A sequence's cache is the GPU
path's layer caches (:mod:`ov_kvcrush.gpu.device_layers`, the same policies the torch engine's
``paged_device`` runs), driven through their model-step entry points: before a step each layer
reserves its slots (:meth:`~ov_kvcrush.gpu.layer_cache.DeviceFullLayerCache.reserve`), the
tables, counts and positions go in as the model's inputs (:func:`~ov_kvcrush.gpu.step_plan.plan_step`
lays a step out), and after it each layer scores and selects on the device from what the model
leaves in our buffers: the step's last query rows, a decode row's logits, a prompt's window sums
(:meth:`~ov_kvcrush.gpu.layer_cache.DeviceFullLayerCache.after_model_step`).

:class:`PluginKVPool` and :class:`PluginKVSequence` answer what the one loop
(:mod:`ov_kvcrush.serving.loop`) asks of the CPU op's :class:`~ov_kvcrush.op.kvcache.KVPool` and
:class:`~ov_kvcrush.op.kvcache.KVSequence`: new sequences, their stats, reset and free.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu import device_layers
from ov_kvcrush.gpu.device import Device
from ov_kvcrush.gpu.kvzip_cache import DeviceKVzipLayerCache
from ov_kvcrush.gpu.layer_cache import DeviceFullLayerCache
from ov_kvcrush.gpu.layout import PoolShape, QuantShape
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.gpu.quant_blocks import QuantBlocks
from ov_kvcrush.gpu.quant_cache import store_shape
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.gpu.step_work import StepWork
from ov_kvcrush.gpu.window_cache import DeviceWindowLayerCache
from ov_kvcrush.methods import MethodConfig, require
from ov_kvcrush.methods.kvzip import KVzipConfig, select_kept
from ov_kvcrush.methods.runtimes import GPU_PLUGIN
from ov_kvcrush.op.kvcache import PoolStats, SequenceStats
from ov_kvcrush.op.plugin import PluginError
from ov_kvcrush.validation import check_int


@dataclass(frozen=True)
class ModelShape:
    """What the caches are made for: the model's attention layers, their heads, scales and
    sliding windows (``windows[i]``: layer ``i``'s; 0 or none given: global)."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    scales: tuple[float, ...]
    windows: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelVariant:
    """Which of the plugin's layers a pool's model runs: over the 2-bit store of ``quant``'s
    blocks, with a method's recall (``recall``: the layer that recalls, ClusterKV's or Quest's),
    or with Chelsea's merge (``merge``); none: the full-precision store's."""

    quant: QuantShape | None = None
    recall: str | None = None
    merge: bool = False


class PluginKVPool:
    """``blocks`` blocks of ``shape`` on the device (a :class:`DevicePool`), shared with the
    plugin, and the sequences of ``method`` over them."""

    def __init__(self, model: ModelShape, shape: PoolShape, blocks: int, method: MethodConfig, dev: Device) -> None:
        require(method, GPU_PLUGIN.name)
        self.model = model
        self.method = method
        self.device_pool = DevicePool(shape, blocks, dev=dev, grow=True)  # one chunk, more as asked
        #: the block the steps' padding is stored in and read from (:mod:`~ov_kvcrush.gpu.step_shape`),
        #: the pool's own: no sequence's
        self.pad_block = self.device_pool.allocate(1)[0]
        #: the 2-bit store's blocks (MiniKV's, or ``quant`` under a method), in a second buffer
        #: the model reads and writes; None for the full-precision store
        quant = store_shape(method, shape)
        self.quant_blocks: QuantBlocks | None = self.device_pool.quant_blocks(quant) if quant else None
        self.block_bytes = shape.block_bytes
        self.peak_blocks = 0
        self.sequences: dict[int, PluginKVSequence] = {}
        self._handles = itertools.count(1)
        #: decode steps fed, and the KV bytes the model's attention read in them (what the bytes
        #: crossing are measured against; the methods' own reads, such as the scores'
        #: recomputation, are the device pool's ``kv_read``)
        self.decode_steps = 0
        self.decode_kv_read = 0
        self.closed = False

    #: its sequences have no snapshot (the CPU op's pool has: :mod:`ov_kvcrush.op.snapshot`)
    snapshots = False

    @property
    def quant(self) -> QuantShape | None:
        """The 2-bit store's block shape; None for the full-precision store."""
        return self.quant_blocks.shape if self.quant_blocks else None

    @property
    def variant(self) -> ModelVariant:
        """The model this pool's steps run (a method's recall inside it)."""
        method = self.method
        return ModelVariant(self.quant, device_layers.model_recall_layer(method), device_layers.model_merges(method))

    def scoring_room(self, step: int) -> int:
        """Slots per head a scoring step of ``step`` tokens needs beside the sequence: its own and
        its view's (the chunk it repeats and the sinks, gathered beside them:
        :meth:`~ov_kvcrush.gpu.kvzip_cache.DeviceKVzipLayerCache.view_room`)."""
        if not isinstance(self.method, KVzipConfig):
            return step
        return step + DeviceKVzipLayerCache.view_room(self.method, step)

    def new_sequence(self) -> PluginKVSequence:
        return PluginKVSequence(self, next(self._handles))

    def stats(self) -> PoolStats:
        """The blocks the sequences hold (the pad block aside), of the pool's capacity."""
        p = self.device_pool
        held = p.blocks_in_use - 1
        self.peak_blocks = max(self.peak_blocks, held)
        return PoolStats(held, p.capacity, self.peak_blocks, self.block_bytes, len(self.sequences))

    def close(self) -> None:
        """Free every sequence (idempotent; the buffer goes with the pool); the model's requests
        bound to it are let go at its next step (:meth:`~ov_kvcrush.engines.gpu_plugin_model.PluginModel.run_step`)."""
        for seq in list(self.sequences.values()):
            seq.free()
        self.closed = True


class PluginKVSequence:
    """One sequence's layer caches in a :class:`PluginKVPool` (``handle``: its id there)."""

    def __init__(self, pool: PluginKVPool, handle: int) -> None:
        self.pool = pool
        self.handle = handle
        self.policy_ns = {"prompt": 0, "decode": 0}
        self.caches = self._new_caches()
        pool.sequences[handle] = self

    def _new_caches(self) -> list[DeviceFullLayerCache]:
        m, p = self.pool.model, self.pool
        windows = m.windows or (0,) * m.layers
        global_layers = windows.count(0)
        caches = []
        for layer, window in enumerate(windows):
            if window:  # a local layer: its window, no method (as on the CPU op)
                cache: DeviceFullLayerCache = DeviceWindowLayerCache(window, p.device_pool, m.kv_heads, m.q_heads)
            else:  # the method over the global layers alone: its budgets those of the n-th of them (the op's)
                g = windows[:layer].count(0)
                cache = device_layers.plugin_layer(p.method, g, global_layers, p.device_pool, m.kv_heads, m.q_heads)
            assert isinstance(cache, DeviceFullLayerCache)
            cache.scale = m.scales[layer]
            caches.append(cache)
        return caches

    @property
    def seen(self) -> int:
        return self.caches[0].seen

    @property
    def several_tokens_after_prompt(self) -> bool:
        """Whether a step of several tokens may follow the prompt (a chat's next turn over the
        kept cache; not over the 2-bit store here: the conversation is fed again)."""
        return all(c.several_tokens_after_prompt for c in self.caches)

    # ---- what the loop asks of a sequence
    def reset(self) -> None:
        """Every block back to the pool; the next step starts at position 0."""
        for cache in self.caches:
            cache.release()
        self.caches = self._new_caches()
        self.policy_ns = {"prompt": 0, "decode": 0}

    def truncate(self, tokens: int) -> None:
        """Forget every token at position ``tokens`` or later (a chat's next turn keeps the prefix
        it shares); a :class:`PluginError` where a layer's heads would keep different counts (the
        loop then resets the sequence and feeds the conversation again)."""
        if tokens >= self.seen:
            return
        if not all(cache.truncate(tokens) for cache in self.caches):
            self.reset()
            raise PluginError(f"cannot truncate to {tokens} tokens: the heads keep different tokens (reset)")

    def set_prompt(self, tokens: int) -> None:
        """The next steps feed a prompt of ``tokens`` tokens in chunks (the sequence must be
        empty): each layer's method scores and selects once, after the last chunk, over the whole
        prompt, as the CPU op's sequence does. ``0``: prompts come whole."""
        check_int("tokens", tokens, 0)
        if tokens and self.seen:
            raise UserError(f"set_prompt: the sequence holds {self.seen} tokens; a prompt in chunks starts empty")
        for cache in self.caches:
            cache.set_prompt(tokens)

    def free(self) -> None:
        if self.handle:
            for cache in self.caches:
                cache.release()
            self.pool.sequences.pop(self.handle, None)
            self.handle = 0

    def head_tokens(self) -> np.ndarray:
        """Tokens held per layer and KV head, ``[layers, kv_heads]``."""
        return np.stack([c.tokens_held()[0].numpy() for c in self.caches]).astype(np.int64)

    def method_counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cache in self.caches:
            for k, v in cache.counters.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def stats(self) -> SequenceStats:
        blocks = sum(len(t) for c in self.caches for t in c.layer.tables)
        qblocks = sum(c.quant_blocks_held() for c in self.caches)
        held = int(self.head_tokens().sum())
        bb, quant = self.pool.block_bytes, self.pool.quant
        kv_bytes = blocks * bb + (qblocks * quant.block_bytes if quant else 0)
        ns = self.policy_ns
        return SequenceStats(blocks, self.seen, held, kv_bytes, qblocks, ns["prompt"], ns["decode"], 0, 0, 0, 0, 0, 0,
                             0, 0, 0, bb)  # fmt: skip

    # ---- the method's scoring pass (KVzip)
    def _scoring_caches(self) -> list[DeviceKVzipLayerCache]:
        """The global layers' caches, the method's, which score (a local layer's attends its
        window through the pass and keeps nothing of it)."""
        caches = [c for c in self.caches if isinstance(c, DeviceKVzipLayerCache)]
        if not caches or len(caches) != sum(c.method_runs for c in self.caches):
            raise UserError(f"method {self.pool.method.name} has no scoring pass")
        return caches

    def _window_caches(self) -> list[DeviceWindowLayerCache]:
        return [c for c in self.caches if isinstance(c, DeviceWindowLayerCache)]

    def score_positions(self, lo: int, hi: int) -> None:
        """The next step is a step of the method's scoring pass that repeats the tokens at
        positions ``[lo, hi)``: the model attends them and the sinks, and they are scored."""
        for cache in [*self._scoring_caches(), *self._window_caches()]:
            cache.score_positions(lo, hi)

    def end_scoring_pass(self, select: bool = True) -> None:
        """End the scoring pass: the method's selection over every layer (``select``; one
        threshold over all layers and heads, or one a layer), or none (a pass that failed: the
        cache stays as it was)."""
        caches = self._scoring_caches()
        self.pool.device_pool.phase = "prompt"  # where its crossings count: compressing the prompt
        for cache in [*caches, *self._window_caches()]:
            cache.end_scoring_pass(keep_scores=select)
        if not select:
            return
        config = caches[0].config
        assert config.budget is not None
        kept = select_kept([c.selection_scores() for c in caches], config.budget, config.allocation)
        for cache, keep in zip(caches, kept, strict=True):
            cache.keep_mask(keep[0].numpy())

    # ---- a step
    def reserve(self, t: int) -> str:
        """Room for a ``t``-token step in every layer; returns the step's phase for this
        sequence (``prompt``: its first tokens; ``decode``: tokens after some)."""
        phase = "prompt" if self.caches[0].in_prompt else "decode"
        for cache in self.caches:
            cache.reserve(t)
        return phase

    def attends_own(self, t: int) -> bool:
        """Whether the next step's ``t`` tokens attend the step's own tokens exactly (asked before
        :meth:`reserve`; the same in every layer)."""
        return self.caches[0].attends_own(t)

    def score_rows(self, t: int) -> int:
        """The query rows the layers read after a ``t``-token step (the same for every layer the
        method runs on; a local layer reads none)."""
        rows = {c.score_rows(t) for c in self.caches if c.method_runs}
        if len(rows) > 1:
            raise UserError(f"the layers of {self.pool.method.name} score different rows: {sorted(rows)}")
        return rows.pop() if rows else 0

    def after_step(
        self, rows: list[Any], t: int, phase: str, logits: list[StepLogits] | None = None, sums: list[Any] | None = None
    ) -> list[StepWork | None]:
        """Each layer's method work after the model's step (``rows``: each layer's device buffer
        of this sequence's last query rows of the step; ``logits``: each layer's of its decode
        row, where the step asked the model for them; ``sums``: each layer's window sums of those
        rows ``[Hq, slots]``, where it asked for them), timed as the op times its policies: the
        layers' rows of the launches over the step's sequences (:func:`~ov_kvcrush.gpu.step_work.launch_step_work`),
        None where a layer did its work here."""
        self.pool.device_pool.phase = phase  # where the work's crossings count
        t0 = time.perf_counter_ns()
        works: list[StepWork | None] = []
        for i, (cache, buffer) in enumerate(zip(self.caches, rows, strict=True)):
            step_logits = logits[i] if logits else None
            work = cache.step_work(t, step_logits) if phase == "decode" else None
            if work is None:
                cache.after_model_step(buffer, t, step_logits, sums[i] if sums else None)
            elif work.then is not None:
                work.then = self._timed(work.then, phase)
            cache.finish_step()
            works.append(work)
        self.policy_ns[phase] += time.perf_counter_ns() - t0
        return works

    def _timed(self, work: Callable[[], None], phase: str) -> Callable[[], None]:
        """``work`` (a layer's own after the step's launches) timed as :meth:`after_step`'s."""

        def run() -> None:
            t0 = time.perf_counter_ns()
            work()
            self.policy_ns[phase] += time.perf_counter_ns() - t0

        return run
