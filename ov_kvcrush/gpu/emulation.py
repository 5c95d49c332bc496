"""OpenVINO's GPU plugin on Intel's OpenCL CPU runtime: how the plugin's own path is verified on
machines with no Intel GPU.

The plugin lists only OpenCL devices of type GPU, so on such a machine it shows none and nothing
of ``device="GPU"`` can run. ``plugins/gpu/emulation/gpu_identity_layer.c`` is an OpenCL loader
layer (the ``OPENCL_LAYERS`` mechanism of the ICD loader the plugin links) that shows the CPU
runtime's device to the plugin as an Xe-LP GPU and mends the few places where the plugin relies on
what an Intel GPU does and the CPU runtime does not (each named in the layer's source). Under it
the plugin compiles and runs models on the CPU runtime: its kernels, SimpleGPU custom layers,
remote tensors. It is a test fixture: it says nothing of a GPU's speed, and a process uses it only
after :func:`enable`.

The layer is read when the process's OpenCL loader starts, so :func:`enable` must come before any
OpenCL call (``openvino`` may be imported, the GPU plugin not yet used); :func:`worker` gives a
fresh process that enables it first. ``python -m ov_kvcrush.gpu.emulation build`` builds it (g++,
cached per source, written whole or not at all); ``... check`` runs a small model on the plugin's
``GPU`` and on ``CPU`` and prints the largest difference (native ``openvino_genai``'s greedy text
on both: ``python -m ov_kvcrush.tools.gpu_native``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import multiprocessing
import os
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ov_kvcrush.gpu import runtime
from ov_kvcrush.gpu.device import kernel_dir
from ov_kvcrush.op import plugin
from ov_kvcrush.outputs import write_atomic

# Imported where used, inside functions: what pulls in openvino, platformdirs, heavy to import, so
# that importing this module stays light.

#: the C compiler's flags for the layer
FLAGS = ("-std=c11", "-O2", "-shared", "-fPIC")
#: the OpenCL headers the layer needs (intel-sycl-rt ships them under the environment's include/)
HEADERS = ("CL/cl.h", "CL/cl_icd.h", "CL/cl_layer.h")
INSTALL_HINT = "pip install intel-sycl-rt (its include/CL headers), and a C compiler"
#: where the layer keeps the programs it built (unset: it builds every program from source)
PROGRAM_CACHE_ENV = "OVKC_PROGRAM_CACHE"
#: the largest allocation the layer shows, with Intel's relaxed allocation limits (unset: the
#: runtime's own, no relaxed limits): ``plugins/gpu/emulation/large_buffers.h``
MAX_ALLOC_ENV = "OVKC_EMULATED_MAX_ALLOC"


def source() -> Path:
    """``plugins/gpu/emulation/gpu_identity_layer.c`` of the source tree, or the packaged copy."""
    return kernel_dir().parent / "emulation" / "gpu_identity_layer.c"


def sources() -> list[Path]:
    """The layer's C files: the layer, its cache of built programs and its emulation of Intel's
    relaxed allocation limits (each with its header)."""
    folder = source().parent
    return [source(), *(folder / f"{name}.{ext}" for name in ("program_cache", "large_buffers") for ext in "ch")]


def _include_dir() -> Path:
    for folder in (Path(sys.prefix) / "include", Path("/usr/include")):
        if all((folder / h).is_file() for h in HEADERS):
            return folder
    raise runtime.GPUPathError(f"the GPU emulation layer needs {', '.join(HEADERS)} ({INSTALL_HINT})")


def _compiler_path() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _compiler() -> str:
    compiler = _compiler_path()
    if compiler is None:
        raise runtime.GPUPathError(f"no C compiler on PATH builds the GPU emulation layer ({INSTALL_HINT})")
    return compiler


def library_path() -> Path:
    """The built layer for this source and compiler (not necessarily built yet)."""
    from ov_kvcrush.paths import cache_root

    text = b"".join(p.read_bytes() for p in sources())
    key = hashlib.sha256(text + " ".join((*FLAGS, _compiler_path() or "")).encode())
    return cache_root() / "plugins" / f"gpu-emulation-{key.hexdigest()[:12]}" / "libovkc_gpu_identity_layer.so"


def build(force: bool = False) -> Path:
    """Compile the layer (well under a second) unless this version is built; returns the library."""
    out = library_path()
    if out.is_file() and not force:
        return out
    include, compiler = _include_dir(), _compiler()
    out.parent.mkdir(parents=True, exist_ok=True)

    def compile_to(tmp: Path) -> None:
        cmd = [compiler, *FLAGS, f"-I{include}", *(str(p) for p in sources() if p.suffix == ".c"), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise runtime.GPUPathError(f"building the GPU emulation layer failed: {proc.stderr.strip()[-2000:]}")

    return write_atomic(out, compile_to)


def unavailable() -> str | None:
    """Why the emulation cannot run here (the runtime, the system's ICD loader, or the layer's
    build is missing), or ``None``: it can (the layer is built if it was not)."""

    if runtime.runtime_library() is None:
        return f"Intel's OpenCL CPU runtime is not installed ({runtime.INSTALL_HINT})"
    if ctypes.util.find_library("OpenCL") is None:
        return "no system OpenCL ICD loader (libOpenCL.so.1, which OpenVINO's GPU plugin links: ocl-icd-libopencl1)"
    try:
        build()
    except runtime.GPUPathError as e:
        return str(e)
    return None


def enable() -> Path:
    """Name the layer in ``OPENCL_LAYERS`` for this process, with Intel's OpenCL CPU runtime
    prepared (:func:`~ov_kvcrush.gpu.runtime.prepare`). Call before the process's first OpenCL
    call; returns the layer."""
    if runtime.runtime_library() is None:
        raise runtime.GPUPathError(f"the GPU emulation needs Intel's OpenCL CPU runtime ({runtime.INSTALL_HINT})")
    runtime.prepare()
    layer = build()
    os.environ["OPENCL_LAYERS"] = str(layer)
    if PROGRAM_CACHE_ENV not in os.environ:
        os.environ[PROGRAM_CACHE_ENV] = str(program_cache())
    return layer


def program_cache() -> Path:
    """The folder of the layer's built programs (``plugins/gpu/emulation/program_cache.c``): the
    CPU runtime's binaries of the programs it built, by source, options, device and runtime version;
    made if missing."""
    from ov_kvcrush.paths import cache_root

    folder = cache_root() / "plugins" / "gpu-emulation-programs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def worker(max_allocation: int | None = None) -> ProcessPoolExecutor:
    """One fresh process whose first act is :func:`enable`: where this process already made an
    OpenCL call (a test run), the plugin's ``GPU`` runs there. ``max_allocation``: the device
    shows that many bytes as its largest allocation, with Intel's relaxed allocation limits
    (:data:`MAX_ALLOC_ENV`)."""
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(1, mp_context=context, initializer=_enable_in_worker, initargs=(max_allocation,))


def _enable_in_worker(max_allocation: int | None) -> None:
    if max_allocation is not None:
        os.environ[MAX_ALLOC_ENV] = str(max_allocation)
    enable()


def plugin_device(core: object) -> str:
    """The full name of the device OpenVINO's GPU plugin found (a :class:`GPUPathError` naming what
    is missing when it found none: the layer was not read, or the loader does not read layers)."""
    if "GPU" not in core.available_devices:  # type: ignore[attr-defined]
        hint = "" if os.environ.get("OPENCL_LAYERS") else ": call ov_kvcrush.gpu.emulation.enable() first"
        raise runtime.GPUPathError(
            "OpenVINO's GPU plugin lists no device under the emulation layer (the ICD loader it links, "
            f"libOpenCL.so.1, must read OPENCL_LAYERS: ocl-icd 2.3 or Khronos' loader){hint}"
        )
    return str(core.get_property("GPU", "FULL_DEVICE_NAME"))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Counts:
    """What the process asked of the emulated GPU since it started: kernels enqueued
    (``kernels``: by name), copies and fills on the device, blocking host waits, bytes copied
    each way between host and device, and programs made from source (``programs``: what a GPU's
    driver compiles; ``layer_programs``: those of the plugin's custom layers, ours, one for each
    new shape of a layer's inputs), and under relaxed allocation limits (:data:`MAX_ALLOC_ENV`)
    the buffers made past the largest allocation and the faults: such a buffer given to a kernel
    built without the option that lets its offsets pass 4 GiB
    (``plugins/gpu/emulation/gpu_identity_layer.c`` says what each counts); the difference of two
    is what was asked between them."""

    kernels: dict[str, int]
    waits: int
    to_device: int
    to_host: int
    device_copies: int
    programs: int
    layer_programs: int
    large_buffers: int
    large_buffer_faults: int

    def kernels_named(self, names: set[str]) -> int:
        """The kernels enqueued whose name is in ``names``."""
        return sum(n for k, n in self.kernels.items() if k in names)

    def __sub__(self, before: Counts) -> Counts:
        kernels = {k: n - before.kernels.get(k, 0) for k, n in self.kernels.items()}
        return Counts(
            {k: n for k, n in kernels.items() if n},
            self.waits - before.waits,
            self.to_device - before.to_device,
            self.to_host - before.to_host,
            self.device_copies - before.device_copies,
            self.programs - before.programs,
            self.layer_programs - before.layer_programs,
            self.large_buffers - before.large_buffers,
            self.large_buffer_faults - before.large_buffer_faults,
        )


def own_kernels() -> set[str]:
    """The names of our kernels (``plugins/gpu/kernels``), as against the plugin's own."""
    import re

    names: set[str] = set()
    for path in kernel_dir().glob("*.cl"):
        names |= set(re.findall(r"__kernel\s+void\s+(\w+)", path.read_text()))
    return names


def _layer() -> ctypes.CDLL:
    """The layer this process's loader loaded (:func:`enable` first)."""
    path = os.environ.get("OPENCL_LAYERS")
    if not path:
        raise runtime.GPUPathError("the emulation layer is not enabled in this process (call enable() first)")
    return ctypes.CDLL(path)


def counts() -> Counts:
    """The layer's counts now (subtract two to count a stretch of work)."""
    lib = _layer()
    n = len(fields(Counts))  # the layer's counts in Counts' order (its first: the kernels' total)
    totals = (ctypes.c_uint64 * n)()
    lib.ovkc_counts(totals, n)
    kernels, name, runs, i = {}, ctypes.create_string_buffer(256), ctypes.c_uint64(), 0
    while lib.ovkc_kernel_runs(i, name, ctypes.c_size_t(256), ctypes.byref(runs)):
        kernels[name.value.decode()] = int(runs.value)
        i += 1
    return Counts(kernels, *(int(n) for n in totals[1:]))


@dataclass(frozen=True)
class CheckResult:
    """A small model on the plugin's ``GPU`` beside ``CPU``."""

    device: str
    max_abs_error: float


def check_model() -> object:
    """What a transformer layer's non-attention part asks of the plugin: a MatMul with constant
    weights (the weights reorder), an RMS norm over signed values (its fused kernel), a softmax."""
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([-1, 64], np.float32, name="x")
    weights = ops.constant(rng.standard_normal((64, 48)).astype(np.float32))
    h = ops.matmul(x, weights, False, False)
    mean_square = ops.reduce_mean(ops.multiply(h, h), np.array([-1], np.int64), True)
    rms = ops.divide(h, ops.sqrt(ops.add(mean_square, np.float32(1e-5))))
    return ov.Model([ops.softmax(rms, -1)], [x], "ovkc_emulation_check")


def check(rows: int = 7) -> CheckResult:
    """Run :func:`check_model` on the plugin's ``GPU`` and on ``CPU`` (both in f32) in this process
    (:func:`enable` called first)."""

    core = plugin.shared_core()
    device = plugin_device(core)
    x = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
    model = check_model()
    out = {d: core.compile_model(model, d, {"INFERENCE_PRECISION_HINT": "f32"})(x)[0] for d in ("CPU", "GPU")}
    return CheckResult(device, float(np.abs(out["GPU"] - out["CPU"]).max()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["build"]:
            print(build(force="--force" in args))
            return 0
        if args[:1] == ["check"]:
            enable()
            result = check()
            print(f"OpenVINO's GPU plugin on {result.device}: largest difference from CPU {result.max_abs_error:.3g}")
            return 0 if result.max_abs_error < 1e-4 else 1
    except runtime.GPUPathError as e:
        print(f"emulation: {e}", file=sys.stderr)
        return 2
    print("usage: python -m ov_kvcrush.gpu.emulation build [--force] | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
