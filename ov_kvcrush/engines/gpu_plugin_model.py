"""The exported model in OpenVINO's GPU plugin with our layers in place of its attention: the
GPU form of the openvino backend (``OpenVINOEngine(..., device="GPU")``): several sequences a
step, side by side (continuous batching through the one loop).

The graph pass (:func:`~ov_kvcrush.transformations.plugin_attention.convert_model_for_plugin`)
puts the store and prefill layers in every layer. :class:`PluginModel` compiles it on a remote
context the plugin makes over our own OpenCL context and queue (the pyopencl host's,
:func:`ov_kvcrush.gpu.device.device`): the pool is our buffer, handed to the plugin as a remote
tensor, and each layer's last query rows come back into our buffers, so the methods' kernels
(:mod:`ov_kvcrush.gpu.plugin_cache`) run over the same blocks between the model's steps, in
order on the one queue, with nothing copied. Python's API takes the handles as hexadecimal
strings (``ov::Any`` reads a ``void*`` from text; an integer is refused: "Bad as from: l to:
Pv"). :mod:`ov_kvcrush.tools.gpu_plugin_check` runs the embedded model through it beside the CPU op.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ov_kvcrush.engines.gpu_plugin_context import (
    buffer_tensor,
    bytes_tensor,
    inference_precision,
    plugin_gpu,
    plugin_uuid,
    shared_context,
)
from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu import layer_inputs, plugin_layers, runtime
from ov_kvcrush.gpu.device import Device, device
from ov_kvcrush.gpu.layout import PoolShape
from ov_kvcrush.gpu.plugin_cache import ModelShape, ModelVariant, PluginKVPool, PluginKVSequence
from ov_kvcrush.gpu.pool import largest_pool
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.gpu.step_plan import DEVICE_TABLES, PluginStep, plan_step
from ov_kvcrush.gpu.step_work import StepLogitRows, StepTables, launch_layer_clusterings, launch_step_work
from ov_kvcrush.gpu.table_mirror import TableMirror
from ov_kvcrush.methods import MethodConfig, require
from ov_kvcrush.methods.runtimes import GPU_PLUGIN
from ov_kvcrush.op import plugin, step_inputs
from ov_kvcrush.transformations.paged_attention import ConvertedModel
from ov_kvcrush.transformations.plugin_attention import (
    LOGITS_INPUT,
    RECALLED_INPUT,
    ROWS_INPUT,
    SCRATCH_INPUT,
    convert_model_for_plugin,
)

#: the model over the full-precision store, without recall (the one every other is compared to)
FULL_PRECISION = ModelVariant()

# Imported where used, inside functions: what pulls in openvino, platformdirs, heavy to import, so
# that importing this module stays light.


@dataclass
class PluginCompilation:
    """What every :class:`PluginModel` of one exported model, device and settings in a process
    shares: the plugin's remote context, the converted model, its compiled models and their
    inference requests. A compiled model keeps the kernels the plugin built for each step shape
    it has run (our layers' programs among them), so a second pipeline of the same model (the
    server's pipeline for another method, an engine made again) starts and steps at once instead
    of compiling each shape again (under the emulation a first run's 22 steps took 33 s, the
    same steps again 0.3 s). The requests of a compiled model share its network: the steps of
    every model sharing it take ``lock``, and a request is destroyed only under it, at a step's
    start or when its engine closes between steps (:meth:`PluginModel.let_go_of_closed_pools`)."""

    context: Any
    converted: ConvertedModel
    #: the compiled model per variant: the full-precision store's, one per 2-bit block shape,
    #: ClusterKV's recall
    compiled_models: dict[ModelVariant, Any] = field(default_factory=dict)
    input_names: set[str] = field(default_factory=set)
    #: every inference request made, by its :class:`PluginRequest`'s key, with the pool it
    #: serves: held here alone until that pool is closed, then let go under ``lock``
    requests: dict[int, tuple[PluginKVPool, Any]] = field(default_factory=dict)
    #: each request's block tables, kept on the device across its steps (a buffer of ours it
    #: holds a handle of: kept until the request is destroyed)
    tables: dict[int, TableMirror] = field(default_factory=dict)
    keys: Iterator[int] = field(default_factory=itertools.count)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: a step is under way (its thread holds ``lock``)
    stepping: bool = False


#: the process's compilations, by model, device and settings (:class:`PluginCompilation`)
_compilations: dict[tuple, PluginCompilation] = {}
_compilations_lock = threading.Lock()


def forget_compilations() -> None:
    """Let go of the process's compilations: the next :class:`PluginModel` of each model compiles
    afresh (the models made before keep theirs)."""
    with _compilations_lock:
        _compilations.clear()


@dataclass(frozen=True)
class PluginRequest:
    """What :meth:`PluginModel.new_request` hands out: the key of one of the model's inference
    requests, which the model alone holds, so that none is destroyed in the middle of a step."""

    key: int


class PluginModel:
    """``model_dir`` (an ``optimum-cli export openvino`` folder) with our layers for the plugin's
    ``GPU``, over our OpenCL context, its pool in ``kv_precision`` blocks of ``block_size``
    tokens: :meth:`compile`, then :meth:`new_pool` and :meth:`new_request`, and :meth:`run_step`
    feeds a step of several sequences."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        kv_precision: str,
        block_size: int,
        gpu: str = "GPU",
        sub_group: int | None = None,
        properties: dict | None = None,
        windows: list[int] | None = None,
        softcap: float = 0.0,
    ) -> None:
        from ov_kvcrush.paths import cache_root

        self.core = plugin.shared_core()
        #: the plugin's device, ``GPU`` or ``GPU.N`` (a GPUPathError naming what is missing, before
        #: anything is built), and its name
        self.gpu = plugin_gpu(self.core, gpu)
        self.device = str(self.core.get_property(self.gpu, "FULL_DEVICE_NAME"))
        self.dev = self._shared_device(sub_group)
        self.properties = dict(properties or {})
        #: the plugin's inference precision, which our layers' activations follow (f16 by default)
        self.activations = inference_precision(self.core, self.gpu, self.properties)
        self.xml = Path(model_dir) / "openvino_model.xml"
        self.kv_precision, self.block_size = kv_precision, block_size
        #: each layer's sliding window (0: a global layer), as the CPU op's (``op_windows``)
        self.windows = tuple(windows or ())
        #: the model's attention soft-capping (Gemma 2's; 0: none), in our layers and kernels
        self.softcap = softcap
        self.shared = self._compilation()
        self.context, self.converted = self.shared.context, self.shared.converted
        s = self.converted.shape
        self.shape = ModelShape(s.layers, s.q_heads, s.kv_heads, s.head_dim, tuple(self.converted.scales), self.windows)
        self.pool_shape = PoolShape(kv_precision, block_size, s.head_dim, s.q_heads // s.kv_heads, softcap)
        attributes = plugin_layers.LayerAttributes(
            self.pool_shape, self.dev.sub_group, self.converted.scales[0], self.activations,
            large_buffers=self.dev.large_buffers,
        )  # fmt: skip
        self.config_file = plugin_layers.write_config(cache_root() / "plugins" / "gpu-plugin-layers", attributes)
        self.rows_inputs = [ROWS_INPUT.format(i) for i in range(s.layers)]
        self.logits_inputs = [LOGITS_INPUT.format(i) for i in range(s.layers)]
        # a recall's lists and a merge's scratch: a global layer's inputs (a local layer runs no method)
        windows = self.windows or (0,) * s.layers
        self.recalled_inputs = [None if w else RECALLED_INPUT.format(i) for i, w in enumerate(windows)]
        self.scratch_inputs = [None if w else SCRATCH_INPUT.format(i) for i, w in enumerate(windows)]
        #: a buffer per layer, reused while large enough: "rows" (the step's returned query
        #: rows), and per place in a step its sequence's rows copied apart: (bytes, buffers)
        self._layer_buffers: dict[str | int, tuple[int, list[Any]]] = {}
        #: the seconds this model spent compiling (none where an earlier one's compilation served)
        self.compile_seconds = 0.0

    def _compilation(self) -> PluginCompilation:
        """The process's compilation of this model, device and settings, made if there is none
        (the exported folder's model file named and dated, so that a model exported again is
        compiled again)."""
        stat = self.xml.stat()
        properties = tuple(sorted((k, str(v)) for k, v in self.properties.items()))
        key = (str(self.xml.resolve()), stat.st_mtime_ns, stat.st_size, self.gpu, id(self.dev), self.kv_precision,
               self.block_size, self.activations, properties, self.windows, self.softcap)  # fmt: skip
        with _compilations_lock:
            if key not in _compilations:
                context = shared_context(self.core, self.dev)
                _compilations[key] = PluginCompilation(context, self._convert(FULL_PRECISION))
            return _compilations[key]

    def _convert(self, variant: ModelVariant) -> ConvertedModel:
        """The exported model read and converted for ``variant`` (its store, its recall)."""
        return convert_model_for_plugin(
            self.core.read_model(self.xml),
            kv_precision=self.kv_precision,
            block_size=self.block_size,
            sub_group=self.dev.sub_group,
            activations=self.activations,
            quant=variant.quant,
            recall=variant.recall,
            merge=variant.merge,
            windows=list(self.windows),
            softcap=self.softcap,
        )

    def _shared_device(self, sub_group: int | None) -> Device:
        """Our OpenCL device for the plugin's ``gpu``: the one of its UUID; for plain ``GPU`` on a
        device that reports none, the first Intel GPU (the plugin's ``GPU`` is its first)."""
        uuid = plugin_uuid(self.core, self.gpu)
        try:
            return device(sub_group, uuid=uuid)
        except runtime.GPUPathError:
            if self.gpu != "GPU":
                raise
            return device(sub_group)

    def compile(self, variant: ModelVariant = FULL_PRECISION) -> Any:
        """The converted model compiled on the shared context (once per variant: the
        full-precision store's, the 2-bit store of a block shape, ClusterKV's recall; converted
        when first asked for)."""
        shared = self.shared
        with shared.lock:
            if variant not in shared.compiled_models:
                self.core.set_property("GPU", {"CONFIG_FILE": str(self.config_file)})  # the plugin's, every GPU.N
                converted = self.converted if variant == FULL_PRECISION else self._convert(variant)
                t0 = time.perf_counter()
                compiled = self.core.compile_model(converted.model, self.context, self.properties)
                shared.compiled_models[variant] = compiled
                self.compile_seconds += time.perf_counter() - t0
                if variant == FULL_PRECISION:
                    shared.input_names = {p.get_any_name() for p in compiled.inputs}
            return shared.compiled_models[variant]

    @property
    def input_names(self) -> set[str]:
        """The full-precision model's input names (the step's inputs of every variant; set when it
        is compiled)."""
        return self.shared.input_names

    def check_method(self, method: MethodConfig) -> None:
        """A ``ConfigError`` unless this path runs ``method`` (beside local layers too: the
        method runs on the global ones)."""
        require(method, GPU_PLUGIN.name)

    def pool_limit(self) -> int:
        """The most blocks a pool may hold: one buffer, the device's largest allocation (its memory
        under Intel's relaxed allocation limits: ``Device.large_buffers``)."""
        return max(1, largest_pool(self.dev, self.pool_shape) or 0)

    def new_pool(self, method: MethodConfig, blocks: int) -> PluginKVPool:
        """A pool of up to ``blocks`` blocks on our device (grown in chunks as they are asked
        for) and ``method``'s sequences over it."""
        return PluginKVPool(self.shape, self.pool_shape, blocks, method, self.dev)

    def new_request(self, pool: PluginKVPool) -> PluginRequest:
        """An inference request of the model for ``pool``'s store (its buffers, which grow, are
        bound at each step), as a key: the model holds the request itself."""
        shared = self.shared
        with shared.lock:
            self.compile()  # the step's input names are the full-precision model's
            handle = PluginRequest(next(shared.keys))
            shared.requests[handle.key] = (pool, self.compile(pool.variant).create_infer_request())
        return handle

    def layer_keys(self, ids: list[int], blocks: int) -> list[Any]:
        """``ids`` prefilled into a full cache of its own (a pool of up to ``blocks`` blocks, closed
        after), then each layer's keys ``[1, kv_heads, n, d]`` as float32 torch tensors: what a
        method's calibration measures (:mod:`~ov_kvcrush.engines.calibration`)."""
        import torch

        from ov_kvcrush.methods import FullConfig

        pool = self.new_pool(FullConfig(), blocks)
        try:
            seq = pool.new_sequence()
            self.run_step(self.new_request(pool), [ids], [seq])
            dev, kv, d = self.dev, self.shape.kv_heads, self.shape.head_dim
            keys = [dev.to_host(c.layer.read_keys(0, len(ids)), np.float32, (kv, len(ids), d)) for c in seq.caches]
            return [torch.from_numpy(k)[None] for k in keys]
        finally:
            pool.close()

    def let_go_of_closed_pools(self) -> None:
        """Destroy the requests of closed pools now where no step is under way (a pool's closer
        calls it: the requests hold the pool's buffers, and a shared compilation's next step may
        be another engine's, or never come); else the next step does it."""
        shared = self.shared
        if not shared.lock.acquire(blocking=False):  # another thread's step: it lets go after
            return
        try:
            if not shared.stepping:  # not from inside a step of this thread (a collector's close)
                self._let_go_of_closed_pools_requests()
        finally:
            shared.lock.release()

    def _let_go_of_closed_pools_requests(self) -> None:
        """Destroy the requests of closed pools, here, before a step binds anything. The plugin's
        requests of one compiled model share its network: one destroyed while another's step was
        under way changed that step's tokens under the emulation (docs/intel_gpu.md). A request
        that a caller held would be destroyed when the caller goes, and a loop (a reference
        cycle) goes when Python's cycle collector runs: at any allocation, in any thread."""
        requests, tables = self.shared.requests, self.shared.tables
        for key in [k for k, (pool, _) in requests.items() if pool.closed]:
            del requests[key]
            tables.pop(key, None)  # after the request that holds it

    def _buffers(self, key: Hashable, nbytes: int) -> list[Any]:
        """A buffer per layer of at least ``nbytes`` for ``key``, grown by doubling: the previous
        step's are read by its methods' kernels before this step writes them (one in-order
        queue)."""
        size, buffers = self._layer_buffers.get(key, (0, []))
        if nbytes > size:
            size = max(nbytes, 2 * size)
            buffers = [self.dev.empty(size) for _ in self.rows_inputs]
            self._layer_buffers[key] = (size, buffers)
        return buffers

    def _sequence_rows(self, step: PluginStep, s: int, buffers: list[Any]) -> list[Any]:
        """Sequence ``s``'s score rows ``[Hq, n, D]`` in each layer: the step's buffers
        themselves when they hold its rows alone, else a copy of its rows on the device."""
        n, first = step.score_rows[s], step.first_rows[s]
        if n == step.returned_rows:
            return buffers
        hq, d = self.shape.q_heads, self.shape.head_dim
        own = self._buffers(s, 4 * hq * n * d)
        total = step.returned_rows * d
        for src, dst in zip(buffers, own, strict=True):
            self.dev.copy_rect(src, total, dst, n * d, 0, hq, n * d, src_at=first * d)
        return own

    def _sequence_sums(self, step: PluginStep, s: int, buffers: list[Any]) -> list[Any]:
        """Sequence ``s``'s window sums ``[Hq, slots]`` in each layer, ``slots`` the most its
        heads hold there: the step's buffers themselves where they lie so (the first sequence, the
        step's longest), else a copy on the device."""
        assert step.sums is not None
        hq, kv, stride = self.shape.q_heads, self.shape.kv_heads, step.sums.stride
        held = step.inputs["kvc_lengths"][:, s * kv : (s + 1) * kv].max(axis=1)
        runs = [c.method_runs for c in step.sequences[s].caches]  # a local layer writes no sums
        if s == 0 and all(n == stride or not r for n, r in zip(held, runs, strict=True)):
            return buffers
        own = self._buffers(("sums", s), 4 * hq * int(held.max()))
        for src, dst, n, r in zip(buffers, own, held, runs, strict=True):
            if r:
                self.dev.copy_rect(src, stride, dst, int(n), 0, hq, int(n), first_row=s * hq)
        return own

    def _bind_layer_buffers(self, request: Any, key: str, names: list[str | None], nbytes: int) -> list[Any]:
        """A buffer per layer of at least ``nbytes`` (:meth:`_buffers`' for ``key``), each bound
        as bytes to its layer's input of ``names`` (the layers write into it in place; None: the
        layer has none)."""
        buffers = self._buffers(key, nbytes)
        for name, buffer in zip(names, buffers, strict=True):
            if name is not None:
                request.set_tensor(name, bytes_tensor(self.context, buffer))
        return buffers

    def run_step(self, handle: PluginRequest, ids: list[list[int]], sequences: list[PluginKVSequence]) -> np.ndarray:
        """Feed ``ids[s]`` after sequence ``s``'s tokens, every sequence in one inference (the
        tokens side by side) through the request of ``handle``: store and attend them in the
        model, then each method's work over the pool; the next-token logits of each sequence
        ``[sequences, vocab]``. A ``RuntimeError`` from the plugin leaves the sequences to be
        reset. The step holds the compilation's lock: its requests share one network."""
        shared = self.shared
        with shared.lock:
            shared.stepping = True
            try:
                return self._run_step(handle, ids, sequences)
            finally:
                shared.stepping = False

    def _run_step(self, handle: PluginRequest, ids: list[list[int]], sequences: list[PluginKVSequence]) -> np.ndarray:
        import openvino as ov

        self._let_go_of_closed_pools_requests()
        if handle.key not in self.shared.requests:
            raise UserError("this inference request served a pool that is closed: make a new one (new_request)")
        request = self.shared.requests[handle.key][1]
        past = [seq.seen for seq in sequences]
        step = plan_step(sequences, [len(x) for x in ids])
        model = step_inputs.ragged_step_inputs(self.input_names, ids, list(range(len(ids))), past)
        model = step.shown.model_tokens(model)  # the padding's tokens after the step's
        feeds = {name: x for name, x in model.items() if name in self.input_names} | step.inputs
        pool = sequences[0].pool
        blocks, kv_pool = pool.quant_blocks, pool.device_pool  # bound each step: both buffers grow
        # the block tables in a buffer of ours, sent as they change: the model's layers and the
        # methods' work read them
        mirror = self.shared.tables.setdefault(handle.key, TableMirror(kv_pool))
        tables = mirror.update({name: feeds.pop(name) for name in DEVICE_TABLES if name in feeds})
        for name, buffer in tables.items():
            request.set_tensor(name, buffer_tensor(self.context, buffer, ov.Type.i32, list(mirror.places[name].shape)))
        s = self.shape
        _, table_rows, width = mirror.places["kvc_tables"].shape
        quant = {}
        if "kvc_qtables" in tables:  # the 2-bit store's: its chunks' evictions move their blocks
            quant = {"quant": tables["kvc_qtables"], "quant_stride": mirror.places["kvc_qtables"].shape[2],
                     "quant_blocks": blocks}  # fmt: skip
        step_tables = StepTables(tables["kvc_tables"], table_rows, width, s.kv_heads, **quant)
        if pool.variant.recall:  # the clusterings due, before the model's recall reads their clusters
            for layer in range(s.layers):
                launch_layer_clusterings(kv_pool, layer, [seq.caches[layer] for seq in sequences], step_tables)
        for name, array in feeds.items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.set_tensor("kvc_pool", bytes_tensor(self.context, kv_pool.buffer))
        if blocks is not None:
            request.set_tensor("kvc_qpool", bytes_tensor(self.context, blocks.buffer))
        stride = step.logit_stride
        if pool.variant.recall or pool.variant.merge:  # the indexes, bounds or degrees (a buffer that grows)
            arena = kv_pool.index_arena()
            request.set_tensor("kvc_index", bytes_tensor(self.context, arena.buffer))
        if pool.variant.recall:  # where each row's list goes
            rows = step.shown.sequences * s.kv_heads
            nbytes = layer_inputs.recalled_bytes(rows, step.map_width, step.candidates)
            self._bind_layer_buffers(request, "recalled", self.recalled_inputs, nbytes)
        if pool.variant.merge:  # where the merging rows work
            self._bind_layer_buffers(request, "scratch", self.scratch_inputs, step.scratch_bytes)
        buffers = self._bind_layer_buffers(
            request, "rows", self.rows_inputs, 4 * s.q_heads * step.returned_rows * s.head_dim
        )
        # the layers write a decode step's logits or a prompt's window sums where the step asks,
        # and a step of decode rows alone's partitions
        tokens = step.shown.tokens  # a query head's rows of logits (the padding's unread)
        logit_buffers = self._bind_layer_buffers(request, "logits", self.logits_inputs, step.logit_bytes)
        request.start_async()  # infer() would read every output back, our buffers too
        request.wait()  # the step's one wait: the plugin finishes the shared queue, then copies the logits
        self.dev.synced()  # the previous step's method work was queued before the model's: done too
        works = []
        for i, seq in enumerate(sequences):
            # a step scored from the logits or the sums does not read its rows (a decode row over
            # the 2-bit store does: its probabilities over both stores)
            reads_rows = step.sums is None or (blocks is not None and step.phases[i] == "decode")
            reads_rows = reads_rows and bool(step.score_rows[i]) and not stride
            rows_i = self._sequence_rows(step, i, buffers) if reads_rows else buffers
            logits_i = [StepLogits(b, stride, tokens, i) for b in logit_buffers] if stride else None
            sums_i = self._sequence_sums(step, i, logit_buffers) if step.sums and step.score_rows[i] else None
            works.append(seq.after_step(rows_i, step.counts[i], step.phases[i], logits_i, sums_i))
        for layer, logit_buffer in enumerate(logit_buffers):  # one launch a kernel over the step's sequences
            layer_logits = StepLogitRows(logit_buffer, stride, tokens) if stride else None
            launch_step_work(kv_pool, layer, [w[layer] for w in works], step_tables, layer_logits,
                             s.q_heads // s.kv_heads)  # fmt: skip
        # the methods' work is left queued: the next step's model runs after it on the one queue
        logits = np.array(request.get_output_tensor(0).data[0], np.float32)
        crossed = kv_pool.crossings[step.phase].to_host
        crossed["logits"] = crossed.get("logits", 0) + logits.nbytes
        return logits


def plugin_engine_model(
    model_dir: Path, windows: list[int], kv_precision: str, block_size: int, properties: dict, gpu: str = "GPU",
    softcap: float = 0.0,
) -> PluginModel:  # fmt: skip
    """The openvino engine's model on ``GPU``, its local layers' windows ``windows`` and its
    attention soft-capping ``softcap`` (the inference precision, f16 or f32, is checked by
    :func:`inference_precision`)."""
    compile_properties = {k: v for k, v in properties.items() if k != "KV_CACHE_PRECISION"}  # our pool's, not its
    return PluginModel(model_dir, kv_precision=kv_precision, block_size=block_size, gpu=gpu,
                       properties=compile_properties, windows=windows, softcap=softcap)  # fmt: skip
