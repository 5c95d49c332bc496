"""The exported model in OpenVINO's GPU plugin with our layers in place of its attention: the
GPU form of the openvino backend (``OpenVINOEngine(..., device="GPU")``), one sequence a step.

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

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.gpu import emulation, plugin_layers, runtime
from ov_kvcrush.gpu.device import Device, device
from ov_kvcrush.gpu.layout import PoolShape
from ov_kvcrush.gpu.plugin_cache import ModelShape, PluginKVPool, PluginKVSequence
from ov_kvcrush.methods import MethodConfig, require
from ov_kvcrush.methods.runtimes import GPU_PLUGIN
from ov_kvcrush.op import plugin, step_inputs
from ov_kvcrush.transformations.plugin_attention import ROWS_OUTPUT, convert_model_for_plugin

# Imported where used, inside functions: what pulls in openvino, platformdirs, heavy to import, so
# that importing this module stays light.


def plugin_gpu(core: Any) -> str:
    """The full name of the ``GPU`` OpenVINO's GPU plugin lists; a :class:`GPUPathError` naming
    what is missing where it lists none (under the emulation layer: the layer's own reason)."""
    if "GPU" in core.available_devices or os.environ.get("OPENCL_LAYERS"):
        return emulation.plugin_device(core)
    listed = ", ".join(core.available_devices)
    raise runtime.GPUPathError(
        f"device GPU needs an Intel GPU that OpenVINO's GPU plugin lists (it lists: {listed}): an Intel GPU with "
        "its OpenCL driver (intel-opencl-icd); without one, use device CPU"
    )


def shared_context(core: Any, dev: Device) -> Any:
    """The plugin's remote context over ``dev``'s OpenCL context and in-order queue: the plugin's
    work and ours are then ordered by the one queue."""
    return core.create_context(
        "GPU", {"CONTEXT_TYPE": "OCL", "OCL_CONTEXT": hex(dev.context.int_ptr), "OCL_QUEUE": hex(dev.queue.int_ptr)}
    )


def buffer_tensor(context: Any, buffer: Any, dtype: Any, shape: list[int]) -> Any:
    """Our OpenCL ``buffer`` as a remote tensor of ``context`` (no copy)."""
    import openvino as ov

    params = {"SHARED_MEM_TYPE": "OCL_BUFFER", "MEM_HANDLE": hex(buffer.int_ptr)}
    return context.create_tensor(dtype, ov.Shape(shape), params)


def inference_precision(core: Any, gpu: str, properties: dict) -> str:
    """``f32`` or ``f16``: the precision the plugin runs the model in, as ``properties`` ask
    (``INFERENCE_PRECISION_HINT``, a string or an ``openvino.Type``) or, unset, the plugin's own
    default for ``gpu`` (f16 on Intel GPUs); a :class:`ConfigError` for another."""
    hint = properties.get("INFERENCE_PRECISION_HINT")
    if hint is None:
        hint = core.get_property(gpu, "INFERENCE_PRECISION_HINT")
    name = str(hint.get_type_name() if hasattr(hint, "get_type_name") else hint).lower()
    aliases = {"f32": "f32", "float32": "f32", "f16": "f16", "float16": "f16"}
    if name not in aliases:
        raise ConfigError("INFERENCE_PRECISION_HINT", hint, "f16 (the GPU's default) or f32 on device GPU")
    return aliases[name]


class PluginModel:
    """``model_dir`` (an ``optimum-cli export openvino`` folder) with our layers for the plugin's
    ``GPU``, over our OpenCL context, its pool in ``kv_precision`` blocks of ``block_size``
    tokens: :meth:`compile`, then :meth:`new_pool` and :meth:`new_request`, and :meth:`run_step`
    feeds one sequence's step."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        kv_precision: str,
        block_size: int,
        sub_group: int | None = None,
        properties: dict | None = None,
    ) -> None:
        from ov_kvcrush.paths import cache_root

        self.core = plugin.shared_core()
        #: the plugin's device (a GPUPathError naming what is missing, before anything is built)
        self.device = plugin_gpu(self.core)
        self.dev = device(sub_group)
        self.context = shared_context(self.core, self.dev)
        self.properties = dict(properties or {})
        #: the plugin's inference precision, which our layers' activations follow (f16 by default)
        self.activations = inference_precision(self.core, "GPU", self.properties)
        self.converted = convert_model_for_plugin(
            self.core.read_model(Path(model_dir) / "openvino_model.xml"),
            kv_precision=kv_precision,
            block_size=block_size,
            sub_group=self.dev.sub_group,
            activations=self.activations,
        )
        s = self.converted.shape
        self.shape = ModelShape(s.layers, s.q_heads, s.kv_heads, s.head_dim, tuple(self.converted.scales))
        self.pool_shape = PoolShape(kv_precision, block_size, s.head_dim, s.q_heads // s.kv_heads)
        attributes = plugin_layers.LayerAttributes(
            self.pool_shape, self.dev.sub_group, self.converted.scales[0], self.activations
        )
        self.config_file = plugin_layers.write_config(cache_root() / "plugins" / "gpu-plugin-layers", attributes)
        self.rows_outputs = [ROWS_OUTPUT.format(i) for i in range(s.layers)]
        self._rows: list[Any] = []  # each layer's buffer of query rows, reused while large enough
        self._rows_bytes = 0
        self.compiled: Any = None
        self.input_names: set[str] = set()
        self.compile_seconds = 0.0

    def compile(self) -> Any:
        """Compile the converted model on the shared context (once)."""
        if self.compiled is None:
            self.core.set_property("GPU", {"CONFIG_FILE": str(self.config_file)})
            t0 = time.perf_counter()
            self.compiled = self.core.compile_model(self.converted.model, self.context, self.properties)
            self.compile_seconds = time.perf_counter() - t0
            self.input_names = {p.get_any_name() for p in self.compiled.inputs}
        return self.compiled

    def check_method(self, method: MethodConfig) -> None:
        """A ``ConfigError`` unless this path runs ``method``."""
        require(method, GPU_PLUGIN.name)

    def new_pool(self, method: MethodConfig, blocks: int) -> PluginKVPool:
        """A pool of ``blocks`` blocks on our device and ``method``'s sequences over it."""
        return PluginKVPool(self.shape, self.pool_shape, blocks, method, self.dev)

    def new_request(self, pool_buffer: Any) -> Any:
        """An inference request whose ``kvc_pool`` is our ``pool_buffer``."""
        import openvino as ov

        request = self.compiled.create_infer_request()
        nbytes = pool_buffer.get_info(self.dev.cl.mem_info.SIZE)
        request.set_tensor("kvc_pool", buffer_tensor(self.context, pool_buffer, ov.Type.u8, [nbytes]))
        return request

    def _rows_buffers(self, nbytes: int) -> list[Any]:
        """Each layer's buffer for a step's query rows (``nbytes`` each): the previous step's are
        read by its methods' kernels before this step's model writes them (one in-order queue)."""
        if nbytes > self._rows_bytes:
            self._rows_bytes = max(nbytes, 2 * self._rows_bytes)
            self._rows = [self.dev.empty(self._rows_bytes) for _ in self.rows_outputs]
        return self._rows

    def run_step(self, request: Any, ids: list[int], sequence: PluginKVSequence) -> np.ndarray:
        """Feed ``ids`` after ``sequence``'s tokens: store and attend them in the model, then the
        method's work over the pool; the next-token logits (last position). A ``RuntimeError``
        from the plugin leaves the sequence to be reset."""
        import openvino as ov

        past, t = sequence.seen, len(ids)
        model = step_inputs.step_inputs(self.input_names, [ids], [0], [past])
        feeds = {name: x for name, x in model.items() if name in self.input_names} | sequence.step_inputs(t)
        for name, array in feeds.items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        s, rows = self.shape, min(int(feeds["kvc_score_rows"][0]), t)
        buffers = self._rows_buffers(4 * s.q_heads * rows * s.head_dim)
        for name, buffer in zip(self.rows_outputs, buffers, strict=True):
            request.set_tensor(name, buffer_tensor(self.context, buffer, ov.Type.f32, [s.q_heads, rows, s.head_dim]))
        request.start_async()  # infer() would read every output back, our buffers too
        request.wait()
        sequence.after_step(buffers, t)
        logits = np.array(request.get_output_tensor(0).data[0, -1], np.float32)
        device_pool = sequence.pool.device_pool
        crossed = device_pool.crossings[device_pool.phase].to_host
        crossed["logits"] = crossed.get("logits", 0) + logits.nbytes
        return logits


def plugin_engine_model(
    model_dir: Path, windows: list[int], kv_precision: str, block_size: int, properties: dict
) -> PluginModel:
    """The openvino engine's model on ``GPU``, checked: global attention layers only (the
    inference precision, f16 or f32, is checked by :func:`inference_precision`)."""
    if any(windows):
        raise UserError(f"{model_dir.name}: device GPU runs global attention layers only (this model has local ones)")
    compile_properties = {k: v for k, v in properties.items() if k != "KV_CACHE_PRECISION"}  # our pool's, not its
    return PluginModel(model_dir, kv_precision=kv_precision, block_size=block_size, properties=compile_properties)
