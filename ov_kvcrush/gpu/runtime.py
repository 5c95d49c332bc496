"""Find an OpenCL device that runs the op's kernels, and the pitfalls of getting one.

On a machine with an Intel GPU the system's OpenCL ICD lists it. Without one, Intel's OpenCL CPU
runtime (the ``intel-opencl-rt`` wheel, with ``intel-cmplr-lib-rt`` beside it) runs the same
OpenCL C with Intel sub-groups and ``half`` on the CPU, which is how the kernels are verified here.
Three pitfalls of that wheel, each handled by :func:`prepare`:

* its ICD file names a placeholder path, so an ICD naming the installed ``libintelocl.so`` is
  written to the cache dir and ``OCL_ICD_VENDORS`` points at it (pyopencl's loader ignores
  ``OCL_ICD_FILENAMES``);
* ``libintelocl`` needs a newer TBB than the one ``openvino`` bundles: once ``openvino`` is
  imported the runtime fails to load and the platform is silently missing. :func:`prepare`
  preloads the runtime's own ``libtbb.so.12`` first, which OpenVINO then runs on too; once
  ``openvino`` was imported first, only a fresh process helps (:func:`isolated`);
* a device is usable only with the sub-group sizes it lists (Xe-HPC refuses 8).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ov_kvcrush.errors import UserError

# Imported where used, inside functions: what pulls in platformdirs, pyopencl, heavy to import, so
# that importing this module stays light.

RUNTIME_LIBRARY = "libintelocl.so"
INSTALL_HINT = "pip install pyopencl intel-opencl-rt intel-cmplr-lib-rt"


class GPUPathError(UserError):
    """No device or runtime can run the GPU path's kernels here; the message names what is missing."""


@dataclass(frozen=True)
class DeviceInfo:
    """The OpenCL device the kernels run on."""

    name: str
    platform: str
    is_gpu: bool
    sub_group_sizes: tuple[int, ...]


def runtime_library() -> Path | None:
    """Intel's OpenCL CPU runtime installed in this environment (``<prefix>/lib/libintelocl.so``)."""
    path = Path(sys.prefix) / "lib" / RUNTIME_LIBRARY
    return path if path.is_file() else None


SYSTEM_ICDS = Path("/etc/OpenCL/vendors")


def _write_icd(folder: Path, name: str, text: str) -> None:
    icd = folder / name
    if not icd.is_file() or icd.read_text() != text:
        tmp = folder / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(icd)


def _icd_dir(library: Path) -> Path:
    """A folder of ICD files: the system's (an Intel GPU's driver among them) and one naming
    ``library``, each written atomically."""
    from ov_kvcrush.paths import cache_root

    folder = cache_root() / "opencl-icd"
    folder.mkdir(parents=True, exist_ok=True)
    for icd in sorted(SYSTEM_ICDS.glob("*.icd")) if SYSTEM_ICDS.is_dir() else []:
        _write_icd(folder, f"system-{icd.name}", icd.read_text())
    _write_icd(folder, "zz-intel-cpu-runtime.icd", f"{library}\n")
    return folder


_prepared = False


def prepare() -> None:
    """Make Intel's OpenCL CPU runtime loadable in this process (a no-op without it). Call before
    ``openvino`` is imported; afterwards the runtime may fail to load (see the module's notes)."""
    global _prepared
    if _prepared:
        return
    _prepared = True
    library = runtime_library()
    if library is None:
        return
    os.environ.setdefault("OCL_ICD_VENDORS", str(_icd_dir(library)))
    tbb = library.parent / "libtbb.so.12"
    if tbb.is_file() and "openvino" not in sys.modules:
        ctypes.CDLL(str(tbb), mode=ctypes.RTLD_GLOBAL)


def opencl() -> Any:
    try:
        import pyopencl
    except ImportError as e:
        raise GPUPathError(f"the GPU path needs pyopencl and an OpenCL runtime ({INSTALL_HINT})") from e
    return pyopencl


#: ``CL_DEVICE_UUID_KHR`` (cl_khr_device_uuid): what OpenVINO's GPU plugin reports as ``DEVICE_UUID``
DEVICE_UUID_KHR = 0x106A


def device_uuid(device: Any) -> bytes | None:
    """The OpenCL device's UUID (cl_khr_device_uuid), or ``None`` where it reports none. Read
    through the system's ICD loader (pyopencl's ``get_info`` does not know the query; a device
    handle dispatches through any loader)."""
    if "cl_khr_device_uuid" not in device.extensions:
        return None
    name = ctypes.util.find_library("OpenCL")
    if name is None:
        return None
    value = (ctypes.c_ubyte * 16)()
    get_info = ctypes.CDLL(name).clGetDeviceInfo
    err = get_info(ctypes.c_void_p(device.int_ptr), ctypes.c_uint(DEVICE_UUID_KHR), ctypes.c_size_t(16), value, None)
    return bytes(value) if err == 0 else None


def find_device(allow_cpu: bool = True, uuid: bytes | None = None) -> Any:
    """The first Intel GPU, else (``allow_cpu``) Intel's OpenCL CPU device with sub-groups; with
    ``uuid``, the device of that UUID (the one OpenVINO's GPU plugin names ``GPU.N``)."""
    prepare()
    cl = opencl()
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        platforms = []
    gpus, cpus = [], []
    for platform in platforms:
        for device in platform.get_devices():
            if "cl_intel_subgroups" not in device.extensions:
                continue
            (gpus if device.type & cl.device_type.GPU else cpus).append(device)
    if uuid is not None:
        for device in gpus + (cpus if allow_cpu else []):
            if device_uuid(device) == uuid:
                return device
        raise GPUPathError(f"no OpenCL device with cl_intel_subgroups has the UUID {uuid.hex()}")
    if gpus:
        return gpus[0]
    if allow_cpu and cpus:
        return cpus[0]
    seen = ", ".join(p.name for p in platforms) or "none"
    wanted = "an Intel GPU" if not allow_cpu else "an Intel GPU or Intel's OpenCL CPU runtime"
    hint = "" if runtime_library() or not allow_cpu else f" ({INSTALL_HINT})"
    if "openvino" in sys.modules and runtime_library() and not cpus:
        hint = " (openvino was imported before the runtime was prepared: call ov_kvcrush.gpu.runtime.prepare() first)"
    raise GPUPathError(f"the GPU path needs {wanted} with cl_intel_subgroups; OpenCL platforms seen: {seen}{hint}")


def describe(device: Any) -> DeviceInfo:
    cl = opencl()
    try:
        sizes = tuple(int(s) for s in device.get_info(cl.device_info.SUB_GROUP_SIZES_INTEL))
    except (cl.Error, AttributeError, TypeError):
        sizes = ()
    return DeviceInfo(device.name.strip(), device.platform.name, bool(device.type & cl.device_type.GPU), sizes)


def _start_worker() -> None:
    prepare()


def isolated() -> ProcessPoolExecutor:
    """One fresh worker process whose first act is :func:`prepare`: where ``openvino`` is already
    imported (a test run, an engine), the kernels run there."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker)


def device_info() -> DeviceInfo:
    """The device the kernels would run on here (a :class:`GPUPathError` naming what is missing)."""
    return describe(find_device())
