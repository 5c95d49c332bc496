"""The GPU path's C++ SYCL host (``plugins/gpu/host/sycl_host.cpp``): built, loaded, and seen from
Python as the device the path's host code drives (:class:`SyclDevice`).

The host is a shared library built with g++ against ``intel-sycl-rt`` (its ``sycl/sycl.hpp`` and
``libsycl``): a SYCL queue on the OpenCL backend that owns the device memory (USM device
allocations) and launches the OpenCL C kernels of ``plugins/gpu/kernels`` through the queue's
native OpenCL context. :class:`SyclDevice` has the methods of the pyopencl host's
:class:`~ov_kvcrush.gpu.device.Device`, so the same pool, layer caches and policies run on
either (``TorchEngine(paged_device="sycl")``); what differs is who owns the memory and launches.

``python -m ov_kvcrush.gpu.sycl_host build`` builds it (cached per source and runtime version,
written whole or not at all); ``... describe`` prints the device it finds.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache, cached_property
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ov_kvcrush.gpu import runtime
from ov_kvcrush.gpu.device import KernelDevice, choose_sub_group, kernel_dir
from ov_kvcrush.outputs import write_atomic

# Imported where used, inside functions: what pulls in platformdirs, heavy to import, so that
# importing this module stays light.

INSTALL_HINT = "pip install intel-sycl-rt (the gpu extra: pip install 'ov_kvcrush[gpu]')"
#: g++'s flags (DT_RPATH, not RUNPATH: libsycl's own dependencies are found beside it too)
FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-Wl,--disable-new-dtags")
#: argument kinds of ``ovkc_sycl_launch``
ARG_POINTER, ARG_INT32, ARG_FLOAT32, ARG_UINT32, ARG_NULL = range(5)


def source() -> Path:
    """``plugins/gpu/host/sycl_host.cpp`` of the source tree, or the copy shipped in the package."""
    return kernel_dir().parent / "host" / "sycl_host.cpp"


def sycl_prefix() -> Path:
    """Where ``intel-sycl-rt`` put ``include/sycl/sycl.hpp`` and ``lib/libsycl.so`` (this
    environment's prefix); a :class:`~ov_kvcrush.gpu.runtime.GPUPathError` naming what is missing."""
    prefix = Path(sys.prefix)
    missing = [p for p in ("include/sycl/sycl.hpp", "lib/libsycl.so", "lib/libOpenCL.so") if not (prefix / p).is_file()]
    if missing:
        raise runtime.GPUPathError(f"the SYCL host needs {', '.join(missing)} under {prefix} ({INSTALL_HINT})")
    return prefix


def _runtime_version() -> str:
    try:
        return metadata.version("intel-sycl-rt")
    except metadata.PackageNotFoundError:
        return "unknown"


def library_path() -> Path:
    """The built host for this source, compiler and runtime (not necessarily built yet)."""
    from ov_kvcrush.paths import cache_root

    text = source().read_bytes() + " ".join((*FLAGS, _runtime_version(), shutil.which("g++") or "")).encode()
    key = hashlib.sha256(text)
    return cache_root() / "plugins" / f"sycl-host-{key.hexdigest()[:12]}" / "libovkc_sycl_host.so"


def build(force: bool = False) -> Path:
    """Compile the host with g++ (2-3 s) unless this version is built; returns the library."""
    out = library_path()
    if out.is_file() and not force:
        return out
    prefix = sycl_prefix()
    compiler = shutil.which("g++")
    if compiler is None:
        raise runtime.GPUPathError("the SYCL host is built with g++, which is not on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    lib = prefix / "lib"

    def compile_to(tmp: Path) -> None:
        cmd = [compiler, *FLAGS, f"-I{prefix / 'include'}", str(source()), f"-L{lib}", "-lsycl", "-lOpenCL",
               f"-Wl,-rpath,{lib}", "-o", str(tmp)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise runtime.GPUPathError(f"building the SYCL host failed: {proc.stderr.strip()[-2000:]}")

    return write_atomic(out, compile_to)  # whole or not at all


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, sz, i32, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_char_p
    signatures = {
        "ovkc_sycl_open": (vp, [ctypes.c_int, cp, sz]),
        "ovkc_sycl_close": (None, [vp]),
        "ovkc_sycl_error": (cp, [vp]),
        "ovkc_sycl_describe": (ctypes.c_int, [vp, cp, sz, ctypes.POINTER(i32), ctypes.POINTER(i32), i32]),
        "ovkc_sycl_build": (ctypes.c_int, [vp, cp, cp, cp, sz]),
        "ovkc_sycl_build_binary": (ctypes.c_int, [vp, cp, sz, cp]),
        "ovkc_sycl_program_binary": (ctypes.c_longlong, [vp, ctypes.c_int, cp, sz]),
        "ovkc_sycl_driver": (ctypes.c_int, [vp, cp, sz]),
        "ovkc_sycl_kernel_names": (ctypes.c_int, [vp, ctypes.c_int, cp, sz]),
        "ovkc_sycl_kernel": (ctypes.c_int, [vp, ctypes.c_int, cp]),
        "ovkc_sycl_launch": (ctypes.c_int, [vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(sz), ctypes.POINTER(sz),
                                            ctypes.c_int, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_uint64)]),
        "ovkc_sycl_alloc": (vp, [vp, sz]),
        "ovkc_sycl_release": (None, [vp, vp]),
        "ovkc_sycl_copy": (ctypes.c_int, [vp, vp, vp, sz]),
        "ovkc_sycl_copy_rect": (ctypes.c_int, [vp, vp, sz, vp, sz, sz, sz]),
        "ovkc_sycl_fill": (ctypes.c_int, [vp, vp, ctypes.c_int, sz]),
        "ovkc_sycl_finish": (ctypes.c_int, [vp]),
    }  # fmt: skip
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@cache
def load() -> ctypes.CDLL:
    """The built host, loaded (built first if needed); Intel's OpenCL CPU runtime prepared first."""
    runtime.prepare()
    return _bind(ctypes.CDLL(str(build())))


@dataclass(eq=False)
class UsmBuffer:
    """Device memory the host allocated (USM): given back when the last reference goes."""

    host: SyclHost
    ptr: int
    nbytes: int

    def __del__(self) -> None:
        if self.host.handle:
            self.host.lib.ovkc_sycl_release(self.host.handle, self.ptr)


class SyclHost:
    """One open device: the queue, the memory it owns, the programs built on it."""

    def __init__(self, allow_cpu: bool = True) -> None:
        self.lib = load()
        why = ctypes.create_string_buffer(1024)
        self.handle = self.lib.ovkc_sycl_open(int(allow_cpu), why, len(why))
        if not self.handle:
            raise runtime.GPUPathError(f"the SYCL host found no device: {why.value.decode()}")

    def check(self, code: int) -> int:
        """``code``, or the host's last error raised where it is negative."""
        if code < 0:
            raise runtime.GPUPathError(f"SYCL host: {self.lib.ovkc_sycl_error(self.handle).decode()}")
        return code

    def describe(self) -> runtime.DeviceInfo:
        name, is_gpu = ctypes.create_string_buffer(256), ctypes.c_int32()
        sizes = (ctypes.c_int32 * 8)()
        n = self.check(self.lib.ovkc_sycl_describe(self.handle, name, len(name), ctypes.byref(is_gpu), sizes, 8))
        return runtime.DeviceInfo(name.value.decode().strip(), "SYCL (OpenCL backend)", bool(is_gpu.value),
                                  tuple(sizes[:n]))  # fmt: skip

    @cached_property
    def identity(self) -> str:
        """The device's name and driver version: what a cached kernel binary is valid for."""
        driver = ctypes.create_string_buffer(256)
        self.check(self.lib.ovkc_sycl_driver(self.handle, driver, len(driver)))
        return f"{self.describe().name} | {driver.value.decode()}"

    def alloc(self, nbytes: int) -> UsmBuffer:
        ptr = self.lib.ovkc_sycl_alloc(self.handle, max(int(nbytes), 4))
        self.check(0 if ptr else -1)  # a null pointer: the host's error says why
        return UsmBuffer(self, ptr, int(nbytes))

    def finish(self) -> None:
        self.check(self.lib.ovkc_sycl_finish(self.handle))

    def close(self) -> None:
        if self.handle:
            self.lib.ovkc_sycl_close(self.handle)
            self.handle = None


def binary_path(text: str, options: list[str], identity: str) -> Path:
    """Where the device binary of ``text`` built with ``options`` on the device ``identity``
    (name and driver) is cached; the kernels' shared headers are part of the key."""
    from ov_kvcrush.paths import cache_root

    key = hashlib.sha256("\0".join([text, *options, identity]).encode())
    for header in sorted(kernel_dir().glob("*.h")):
        key.update(header.read_bytes())
    return cache_root() / "plugins" / "sycl-kernels" / f"{key.hexdigest()[:24]}.bin"


def save_binary(host: SyclHost, program: int, path: Path) -> None:
    """The device binary of a built ``program``, written to ``path`` whole or not at all."""
    size = host.check(host.lib.ovkc_sycl_program_binary(host.handle, program, None, 0))
    if size <= 0:
        return  # nothing to keep: the next process builds the source again
    binary = ctypes.create_string_buffer(size)
    host.check(host.lib.ovkc_sycl_program_binary(host.handle, program, binary, size))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_bytes(binary.raw))


def _arg(value: Any) -> tuple[int, int]:
    """A kernel argument's kind and 64-bit value (``ovkc_sycl_launch``)."""
    if value is None:
        return ARG_NULL, 0
    if isinstance(value, UsmBuffer):
        return ARG_POINTER, value.ptr
    if isinstance(value, np.int32):
        return ARG_INT32, int(value.view(np.uint32))
    if isinstance(value, np.uint32):
        return ARG_UINT32, int(value)
    if isinstance(value, np.float32):
        return ARG_FLOAT32, int(value.view(np.uint32))
    raise TypeError(f"a kernel argument is a device buffer, np.int32, np.uint32 or np.float32, not {type(value)}")


@dataclass(frozen=True)
class SyclKernel:
    index: int
    function_name: str


@dataclass
class SyclDevice(KernelDevice):
    """The pyopencl host's :class:`~ov_kvcrush.gpu.device.Device`, through the SYCL host: the same
    kernels, built with the same constants, on memory the C++ host owns."""

    host: SyclHost
    sub_group: int
    kernels: dict[tuple[str, str, tuple[tuple[str, int], ...]], SyclKernel] = field(default_factory=dict)
    #: programs built, by where from: OpenCL C ``source``, or a ``binary`` an earlier process built
    builds: dict[str, int] = field(default_factory=lambda: {"source": 0, "binary": 0})

    def build(self, text: str, options: list[str]) -> dict[str, SyclKernel]:
        """The kernels of ``text``: from the device binary an earlier process built for this
        source, its headers, options, device and driver where one is cached (a driver's build of
        every source takes seconds), else built from source and their binary cached."""
        h, lib = self.host.handle, self.host.lib
        opts = " ".join(options).encode()
        cached = binary_path(text, options, self.host.identity)
        program = -1
        if cached.is_file():
            binary = cached.read_bytes()
            program = lib.ovkc_sycl_build_binary(h, binary, len(binary), opts)  # -1: refused, build the source
        if program >= 0:
            self.builds["binary"] += 1
        else:
            log = ctypes.create_string_buffer(1 << 16)
            program = self.host.check(lib.ovkc_sycl_build(h, text.encode(), opts, log, len(log)))
            self.builds["source"] += 1
            save_binary(self.host, program, cached)
        names = ctypes.create_string_buffer(1 << 14)
        self.host.check(lib.ovkc_sycl_kernel_names(h, program, names, len(names)))
        return {
            name: SyclKernel(self.host.check(lib.ovkc_sycl_kernel(h, program, name.encode())), name)
            for name in names.value.decode().split(";")
        }

    def run(
        self, kernel: SyclKernel, global_size: tuple[int, ...], local_size: tuple[int, ...] | None, *args: Any
    ) -> None:
        """Launch ``kernel`` over ``global_size`` (OpenCL's order: the fastest-varying first) in
        work-groups of ``local_size`` (None: the runtime's choice), as pyopencl would."""
        dims = len(global_size)
        g = (ctypes.c_size_t * 3)(*global_size, *(1,) * (3 - dims))
        local = tuple(local_size) if local_size else (0,) * dims
        loc = (ctypes.c_size_t * 3)(*local, *(1,) * (3 - dims))
        kinds, values = zip(*(_arg(a) for a in args), strict=True) if args else ((), ())
        k = (ctypes.c_int32 * len(args))(*kinds)
        v = (ctypes.c_uint64 * len(args))(*values)
        self.host.check(self.host.lib.ovkc_sycl_launch(self.host.handle, kernel.index, dims, g, loc, len(args), k, v))

    def to_device(self, array: np.ndarray) -> UsmBuffer:
        data = np.ascontiguousarray(array)
        buffer = self.host.alloc(data.nbytes)
        self.host.check(self.host.lib.ovkc_sycl_copy(self.host.handle, buffer.ptr, data.ctypes.data, data.nbytes))
        self.host.finish()  # the host array may go as soon as this returns
        return buffer

    def empty(self, nbytes: int) -> UsmBuffer:
        return self.host.alloc(nbytes)

    def copy_rect(
        self, src: UsmBuffer, src_stride: int, dst: UsmBuffer, dst_stride: int, at: int, rows: int, n: int,
        first_row: int = 0, src_at: int = 0,
    ) -> None:  # fmt: skip
        if n and rows:
            self.host.check(self.host.lib.ovkc_sycl_copy_rect(
                self.host.handle, dst.ptr + 4 * at, 4 * dst_stride, src.ptr + 4 * (src_stride * first_row + src_at),
                4 * src_stride, 4 * n, rows))  # fmt: skip

    def copy_bytes(self, src: UsmBuffer, dst: UsmBuffer, nbytes: int, dst_offset: int) -> None:
        if nbytes:
            self.host.check(self.host.lib.ovkc_sycl_copy(self.host.handle, dst.ptr + dst_offset, src.ptr, nbytes))

    def clear(self, buffer: UsmBuffer, nbytes: int) -> None:
        self.host.check(self.host.lib.ovkc_sycl_fill(self.host.handle, buffer.ptr, 0, max(int(nbytes), 4)))

    def to_host(self, buffer: UsmBuffer, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.host.check(self.host.lib.ovkc_sycl_copy(self.host.handle, out.ctypes.data, buffer.ptr, out.nbytes))
        self.host.finish()
        return out


@cache
def sycl_device(sub_group: int | None = None) -> SyclDevice:
    """The process's SYCL host device (an Intel GPU, else Intel's OpenCL CPU runtime) at
    ``sub_group`` lanes (:func:`~ov_kvcrush.gpu.device.choose_sub_group`), as
    :func:`ov_kvcrush.gpu.device.device`."""
    host = SyclHost()
    return SyclDevice(host, choose_sub_group(sub_group, host.describe()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["build"]:
            print(build(force="--force" in args))
            return 0
        if args[:1] == ["describe"]:
            print(SyclHost().describe())
            return 0
    except runtime.GPUPathError as e:
        print(f"sycl_host: {e}", file=sys.stderr)
        return 2
    print("usage: python -m ov_kvcrush.gpu.sycl_host build [--force] | describe", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
