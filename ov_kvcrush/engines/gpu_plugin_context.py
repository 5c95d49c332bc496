"""How the GPU plugin and our OpenCL host share one device (the openvino backend's ``device="GPU"``,
:mod:`~ov_kvcrush.engines.gpu_plugin_model`): the GPU named (``GPU`` or ``GPU.N``) checked against
those the plugin lists, its UUID (the OpenCL device our kernels must run on), the plugin's remote
context over our own OpenCL context and queue, our buffers as its tensors, and the precision it
infers at. Python's API takes the handles as hexadecimal strings (``ov::Any`` reads a ``void*``
from text; an integer is refused: "Bad as from: l to: Pv").
"""

from __future__ import annotations

import os
from typing import Any

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.gpu import emulation, runtime
from ov_kvcrush.gpu.device import Device


def plugin_gpu(core: Any, name: str = "GPU") -> str:
    """``name`` (``GPU``, or ``GPU.N`` on a machine with several) checked against the GPUs
    OpenVINO's GPU plugin lists; a :class:`GPUPathError` naming what is missing where it lists
    none (under the emulation layer: the layer's own reason), or naming those it lists."""
    if os.environ.get("OPENCL_LAYERS"):
        emulation.plugin_device(core)  # the layer's own reason where the plugin lists no GPU
    if not any(d.split(".")[0] == "GPU" for d in core.available_devices):
        raise runtime.GPUPathError(
            f"device {name} needs an Intel GPU that OpenVINO's GPU plugin lists (it lists: "
            f"{', '.join(core.available_devices)}): an Intel GPU with its OpenCL driver (intel-opencl-icd); "
            "without one, use device CPU"
        )
    # the plugin answers to GPU.N for each of its device ids, one GPU or several
    listed = [f"GPU.{i}" for i in core.get_property("GPU", "AVAILABLE_DEVICES")]
    if name != "GPU" and name not in listed:
        raise ConfigError("device", name, f"one of {', '.join(['GPU', *listed])} (the GPUs OpenVINO's plugin lists)")
    return name


def plugin_uuid(core: Any, gpu: str) -> bytes | None:
    """The plugin's ``DEVICE_UUID`` of ``gpu``: the OpenCL device our kernels must share with it."""
    text = "".join(c for c in str(core.get_property(gpu, "DEVICE_UUID")) if c in "0123456789abcdefABCDEF")
    return bytes.fromhex(text) if len(text) == 32 else None


def shared_context(core: Any, dev: Device) -> Any:
    """The plugin's remote context over ``dev``'s OpenCL context and in-order queue: the plugin's
    work and ours are then ordered by the one queue."""
    return core.create_context(
        "GPU", {"CONTEXT_TYPE": "OCL", "OCL_CONTEXT": hex(dev.context.int_ptr), "OCL_QUEUE": hex(dev.queue.int_ptr)}
    )


#: the shape our buffers of bytes (the pool, the 2-bit blocks, the index words, each layer's rows,
#: logits, lists and scratch) are shown to the plugin at, whatever their size: the plugin's JIT
#: writes every input's dims into our layers' programs, so a buffer that grew compiled every layer
#: again (:mod:`~ov_kvcrush.gpu.step_shape`); our kernels read no dims, only the block ids and
#: offsets the host gives (it sizes the buffers, and refuses a table naming a block past the pool)
BYTES_SHAPE = [1]


def buffer_tensor(context: Any, buffer: Any, dtype: Any, shape: list[int]) -> Any:
    """Our OpenCL ``buffer`` as a remote tensor of ``context`` (no copy)."""
    import openvino as ov

    params = {"SHARED_MEM_TYPE": "OCL_BUFFER", "MEM_HANDLE": hex(buffer.int_ptr)}
    return context.create_tensor(dtype, ov.Shape(shape), params)


def bytes_tensor(context: Any, buffer: Any) -> Any:
    """Our OpenCL ``buffer`` of bytes as a remote tensor of ``context``, shown at :data:`BYTES_SHAPE`."""
    import openvino as ov

    return buffer_tensor(context, buffer, ov.Type.u8, BYTES_SHAPE)


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
