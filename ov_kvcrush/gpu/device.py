"""The device the op's OpenCL kernels (``plugins/gpu/kernels/*.cl``) run on, and their builds.

Each kernel source is built once per device and per set of compile-time constants (sub-group
size, store precision, block size, head size, query group), as OpenVINO's GPU plugin builds its
kernels with JIT constants. Arrays go in and out as numpy arrays in the CPU op's layouts
(:mod:`ov_kvcrush.gpu.layout`), so every result can be checked against the torch reference and
the CPU op. Runs in a process where :func:`ov_kvcrush.gpu.runtime.prepare` came first.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ov_kvcrush.gpu import runtime


def kernel_dir() -> Path:
    """``plugins/gpu/kernels`` of the source tree, or the copy shipped in the package."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package.parent / "plugins" / "gpu" / "kernels", package / "plugins" / "gpu" / "kernels"):
        if candidate.is_dir():
            return candidate
    raise runtime.GPUPathError(f"the OpenCL kernels (plugins/gpu/kernels) are not found next to {package}")


def kernel_define(source: str, name: str) -> int:
    """The integer ``#define name`` of kernel file ``source``: a layout's one copy (a row's fields),
    which the host that packs the rows reads rather than repeats."""
    defines = kernel_defines(source)
    if name not in defines:
        raise AssertionError(f"{source} defines {name}")
    return defines[name]


@cache
def kernel_defines(source: str) -> dict[str, int]:
    """Every integer ``#define`` of kernel file ``source`` (a value in parentheses, a comment after
    it), by name: the rows' layouts that the hosts packing them read rather than repeat."""
    text = (kernel_dir() / source).read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define (\w+) \(?(-?\d+)\)?", text, re.M)}


def kernel_sources() -> list[Path]:
    return sorted(kernel_dir().glob("*.cl"))


#: Intel's extension by which one buffer may pass ``CL_DEVICE_MAX_MEM_ALLOC_SIZE`` (about 4 GiB
#: on Arc cards; Intel's guide "Allocations greater than 4GB"): such a buffer is made with
#: :data:`UNRESTRICTED_SIZE` (``CL_MEM_ALLOW_UNRESTRICTED_SIZE_INTEL``), and every kernel that
#: reads it is built with :data:`LARGE_BUFFER_OPTION` (64-bit offsets)
RELAX_ALLOCATION_LIMITS = "cl_intel_relax_allocation_limits"
UNRESTRICTED_SIZE = 1 << 23
LARGE_BUFFER_OPTION = "-cl-intel-greater-than-4GB-buffer-required"


def compiler_options(large_buffers: bool = False) -> list[str]:
    """The options every host builds our kernels with (the pyopencl and SYCL hosts, ``ocloc``, the
    plugin's layers): correctly rounded division (a 2-bit code is round((x - zero) / scale), as the
    reference divides), and on a device whose buffers may pass its largest allocation
    (``large_buffers``) the option that lets a kernel read them."""
    return ["-cl-fp32-correctly-rounded-divide-sqrt", *([LARGE_BUFFER_OPTION] if large_buffers else [])]


def build_options(sub_group: int, constants: dict[str, int | str], large_buffers: bool = False) -> list[str]:
    """The compile options of a kernel source: its constants, the kernels' folder for the headers
    they share (``paged_block.h``), and :func:`compiler_options`."""
    consts = (f"-D{k}={v}" for k, v in sorted(constants.items()))
    return [f"-DSG={sub_group}", *consts, f"-I{kernel_dir()}", *compiler_options(large_buffers)]


class KernelDevice:
    """What the path's host code drives: the kernels built per set of constants, device buffers,
    launches and copies. Two hosts implement it: pyopencl's :class:`Device`, and the C++ SYCL
    host's :class:`~ov_kvcrush.gpu.sycl_host.SyclDevice`; each overrides how a source is built
    (:meth:`build`) and the buffer primitives, and shares the rest here."""

    sub_group: int
    kernels: dict[tuple[str, str, tuple[tuple[str, int], ...]], Any]
    #: one buffer may pass the device's largest allocation (:data:`RELAX_ALLOCATION_LIMITS`), so
    #: every kernel is built with :data:`LARGE_BUFFER_OPTION`
    large_buffers: bool = False

    def build(self, text: str, options: list[str]) -> dict[str, Any]:
        """The kernels of OpenCL C ``text`` built with ``options``, by function name."""
        raise NotImplementedError

    def kernel(self, source: str, name: str, constants: dict[str, int | str]) -> Any:
        """Kernel ``name`` of ``source`` built for ``constants`` (each source built once per set)."""
        key = (source, name, tuple(sorted(constants.items())))
        if key not in self.kernels:
            options = build_options(self.sub_group, constants, self.large_buffers)
            built = self.build((kernel_dir() / source).read_text(), options)
            for function_name, k in built.items():
                self.kernels[(source, function_name, key[2])] = k
        return self.kernels[key]

    def empty(self, nbytes: int) -> Any:
        raise NotImplementedError

    def largest_allocation(self) -> int | None:
        """The most bytes one buffer may hold on this device (``CL_DEVICE_MAX_MEM_ALLOC_SIZE``, or
        its memory where :attr:`large_buffers`); None where the host does not say."""
        return None

    def view_align(self) -> int | None:
        """The words a view's offset must be a multiple of (:meth:`view`); None where this host
        makes no views of a buffer."""
        return None

    def view(self, buffer: Any, offset: int, nbytes: int) -> Any:
        """Bytes ``offset .. offset + nbytes`` of ``buffer`` as a buffer of their own (the same
        memory; ``offset`` a multiple of :meth:`view_align` words)."""
        raise NotImplementedError

    def copy_rect(
        self, src: Any, src_stride: int, dst: Any, dst_stride: int, at: int, rows: int, n: int, first_row: int = 0,
        src_at: int = 0,
    ) -> None:  # fmt: skip
        """Copy ``n`` 4-byte elements from element ``src_at`` of rows ``first_row ..`` of ``src``
        to elements ``at ..`` of the rows of ``dst`` (strides in elements), on the device."""
        raise NotImplementedError

    def clear(self, buffer: Any, nbytes: int) -> None:
        """The first ``nbytes`` of ``buffer`` set to zero, on the device (nothing crosses)."""
        raise NotImplementedError

    def copy_rows(self, src: Any, src_stride: int, rows: int, n: int, first_row: int = 0) -> Any:
        """A new buffer of the first ``n`` floats of rows ``first_row ..`` (``rows`` of them) of
        ``src`` (row stride ``src_stride`` floats), packed: a copy on the device."""
        dst = self.empty(4 * rows * max(n, 1))
        self.copy_rect(src, src_stride, dst, n, 0, rows, n, first_row)
        return dst

    def zeros(self, nbytes: int) -> Any:
        """A new buffer of ``nbytes`` zero bytes, filled on the device (nothing crosses)."""
        buffer = self.empty(nbytes)
        self.clear(buffer, nbytes)
        return buffer


@dataclass
class Device(KernelDevice):
    """An OpenCL context and queue on one device, with its built programs (the pyopencl host)."""

    cl: Any
    device: Any
    context: Any
    queue: Any
    sub_group: int
    kernels: dict[tuple[str, str, tuple[tuple[str, int], ...]], Any] = field(default_factory=dict)
    #: every buffer made, or used by a command enqueued, since the queue was last known idle, held
    #: until then: a buffer Python drops while a queued command still uses it is released at
    #: once, and Intel's OpenCL CPU runtime hands its memory to the next buffer under that command
    #: (a kernel's temporary argument overwritten by the next upload: seen as a nondeterministic
    #: token under continuous batching on device GPU; a method's scores or positions replaced by
    #: their gather while it reads them). The SYCL host frees a buffer only after the work queued
    #: before it.
    in_flight: list[Any] = field(default_factory=list)

    #: the device's largest single allocation (``CL_DEVICE_MAX_MEM_ALLOC_SIZE``), read once
    max_alloc: int = field(init=False)

    def __post_init__(self) -> None:
        self.large_buffers = RELAX_ALLOCATION_LIMITS in str(self.device.extensions).split()
        self.max_alloc = int(self.device.max_mem_alloc_size)

    def largest_allocation(self) -> int | None:
        return int(self.device.global_mem_size) if self.large_buffers else self.max_alloc

    def view_align(self) -> int | None:
        return max(1, int(self.device.mem_base_addr_align) // 32)  # bits to 4-byte words

    def view(self, buffer: Any, offset: int, nbytes: int) -> Any:
        return buffer.get_sub_region(offset, nbytes)  # a sub-buffer: it keeps its parent alive

    def synced(self) -> None:
        """Every command enqueued so far has finished (a blocking read returned, an inference
        sharing the queue was waited for): the buffers made before may be released."""
        self.in_flight.clear()

    def build(self, text: str, options: list[str]) -> dict[str, Any]:
        with warnings.catch_warnings():  # the CPU runtime's vectorisation remarks
            warnings.simplefilter("ignore", self.cl.CompilerWarning)
            program = self.cl.Program(self.context, text).build(options=options)
        return {k.function_name: k for k in program.all_kernels()}

    def run(self, kernel: Any, global_size: tuple[int, ...], local_size: tuple[int, ...], *args: Any) -> None:
        kernel.set_args(*args)
        self.cl.enqueue_nd_range_kernel(self.queue, kernel, global_size, local_size)
        self.in_flight.extend(a for a in args if isinstance(a, self.cl.MemoryObjectHolder))

    def to_device(self, array: np.ndarray) -> Any:
        flags = self.cl.mem_flags.READ_WRITE | self.cl.mem_flags.COPY_HOST_PTR
        buffer = self.cl.Buffer(self.context, flags, hostbuf=np.ascontiguousarray(array))
        self.in_flight.append(buffer)
        return buffer

    def empty(self, nbytes: int) -> Any:
        flags = self.cl.mem_flags.READ_WRITE
        if self.large_buffers and nbytes > self.max_alloc:
            flags |= UNRESTRICTED_SIZE
        buffer = self.cl.Buffer(self.context, flags, max(int(nbytes), 4))
        self.in_flight.append(buffer)
        return buffer

    def copy_rect(
        self, src: Any, src_stride: int, dst: Any, dst_stride: int, at: int, rows: int, n: int, first_row: int = 0,
        src_at: int = 0,
    ) -> None:  # fmt: skip
        if n and rows:
            self.cl.enqueue_copy(self.queue, dst, src, src_origin=(4 * src_at, first_row), dst_origin=(4 * at, 0),
                                 region=(4 * n, rows), src_pitches=(4 * src_stride,),
                                 dst_pitches=(4 * dst_stride,))  # fmt: skip
            self.in_flight += (src, dst)

    def copy_bytes(self, src: Any, dst: Any, nbytes: int, dst_offset: int) -> None:
        """``nbytes`` of ``src`` to byte ``dst_offset ..`` of ``dst``, on the device."""
        if nbytes:
            self.cl.enqueue_copy(self.queue, dst, src, byte_count=nbytes, dst_offset=dst_offset)
            self.in_flight += (src, dst)

    def clear(self, buffer: Any, nbytes: int) -> None:
        self.cl.enqueue_fill_buffer(self.queue, buffer, np.uint8(0), 0, max(int(nbytes), 4))

    def to_host(self, buffer: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.cl.enqueue_copy(self.queue, out, buffer)  # blocking: the in-order queue is idle after it
        self.synced()
        return out


class Transfers(Protocol):
    """Where a host's copies between host and device go: straight to the device, or through a
    decode's pool, which counts them (:class:`ov_kvcrush.gpu.pool.DevicePool`)."""

    def upload(self, what: str, array: np.ndarray) -> Any: ...

    def download(self, what: str, buffer: Any, dtype: type, shape: tuple[int, ...]) -> np.ndarray: ...


@dataclass
class DirectTransfers:
    """Copies straight to and from the device, uncounted (the kernels' numpy hosts)."""

    dev: KernelDevice

    def upload(self, what: str, array: np.ndarray) -> Any:
        return self.dev.to_device(array)

    def download(self, what: str, buffer: Any, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        return self.dev.to_host(buffer, np.dtype(dtype), shape)


@dataclass
class HeadsOnDevice:
    """One layer's KV heads as the kernels read them: the pool's device buffer, the block tables
    ``[kv, table_stride]`` int32, the token counts ``[kv]`` and (prompt attention) each slot's
    position ``[kv, pos_stride]``."""

    pool: Any
    tables: Any
    table_stride: int
    lengths: Any
    positions: Any = None
    pos_stride: int = 0


def choose_sub_group(sub_group: int | None, info: runtime.DeviceInfo) -> int:
    """``sub_group`` lanes (default: 16 where listed) on the device ``info`` describes; a size the
    device does not list is an error naming the allowed ones."""
    sizes = info.sub_group_sizes or (8, 16, 32)
    chosen = sub_group if sub_group is not None else (16 if 16 in sizes else sizes[0])
    if chosen not in sizes:
        raise runtime.GPUPathError(f"sub_group={chosen} is not supported by {info.name}: allowed {sizes}")
    return chosen


@cache
def device(sub_group: int | None = None, uuid: bytes | None = None) -> Device:
    """The process's device (an Intel GPU, else Intel's OpenCL CPU runtime; with ``uuid``, the
    device of that UUID) at ``sub_group`` lanes (:func:`choose_sub_group`)."""
    cl = runtime.opencl()
    dev = runtime.find_device(uuid=uuid)
    chosen = choose_sub_group(sub_group, runtime.describe(dev))
    context = cl.Context([dev])
    return Device(cl, dev, context, cl.CommandQueue(context), chosen)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
