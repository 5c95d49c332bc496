"""The CPU extension library (``plugins/cpu``): build it and load it (its KV cache: :mod:`ov_kvcrush.op.kvcache`).

The library holds the ``ov_kvcrush::PagedAttention`` op and the paged block cache it owns. It is
built with CMake against the OpenVINO runtime of the installed ``openvino`` wheel (headers and
``OpenVINOConfig.cmake`` ship with it), once per source version, OpenVINO version and machine,
into the user cache dir; ``make setup`` builds it, and :func:`library_path` builds it on first use
otherwise. ``OV_KVCRUSH_PLUGIN=/path/libov_kvcrush_cpu.so`` uses a library built elsewhere.

The same library is opened twice in the process: by OpenVINO (``core.add_extension``), which
runs the op, and by :mod:`ctypes` here (:func:`load`), whose C API :mod:`ov_kvcrush.op.kvcache`
wraps. ``dlopen`` of one path returns one handle, so both see the same pools and sequences.

``python -m ov_kvcrush.op.plugin build`` builds (or finds) the library and prints its path.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.op import bf16_choice

# Imported where used, inside functions: what pulls in openvino, platformdirs, heavy to import, so
# that importing this module stays light.

LIBRARY_NAME = "libov_kvcrush_cpu.so"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None
_core: Any = None
_bf16: bf16_choice.Bf16Choice | None = None


class PluginError(UserError):
    """The extension library could not be built or loaded, or its C API reported an error."""


def source_dir() -> Path:
    """``plugins/cpu`` of the source tree (an editable install), or the copy shipped in the package."""
    package = Path(__file__).resolve().parents[1]  # ov_kvcrush/
    for candidate in (package.parent / "plugins" / "cpu", package / "plugins" / "cpu"):
        if (candidate / "CMakeLists.txt").is_file():
            return candidate
    raise PluginError(f"the C++ sources of the CPU extension (plugins/cpu) are not found next to {package}")


def _openvino_cmake_dir() -> Path:
    import openvino

    path = Path(openvino.__file__).parent / "cmake"
    if not (path / "OpenVINOConfig.cmake").is_file():
        raise PluginError(f"the openvino wheel has no OpenVINOConfig.cmake under {path}: cannot build the extension")
    return path


def _build_key(src: Path) -> str:
    """Digest of everything the build depends on: sources, OpenVINO version, machine, flags."""
    import openvino

    h = hashlib.sha256()
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(src)).encode())
        h.update(f.read_bytes())
    h.update(openvino.__version__.encode())
    h.update(platform.machine().encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:12]


def _cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native): a different CPU builds anew."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _tool(name: str) -> str | None:
    venv_bin = Path(sys.executable).parent / name
    return str(venv_bin) if venv_bin.is_file() else shutil.which(name)


def build_dir() -> Path:
    from ov_kvcrush.paths import cache_root

    return cache_root() / "plugins" / f"cpu-{_build_key(source_dir())}"


def build(force: bool = False, verbose: bool = False) -> Path:
    """Configure and build the library unless an up-to-date build exists; returns its path.

    Concurrent builds (two test workers, two pipelines) wait on a file lock, so only one runs.
    """
    src = source_dir()
    out = build_dir()
    lib = out / LIBRARY_NAME
    if lib.is_file() and not force:
        return lib
    cmake = _tool("cmake")
    if cmake is None:
        raise PluginError(
            "cmake is not installed: `pip install cmake` (the package depends on it) to build the extension"
        )
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file() and not force:
            return lib
        work = out / "build"
        cfg = [cmake, "-S", str(src), "-B", str(work), "-DCMAKE_BUILD_TYPE=Release"]
        cfg += [f"-DOpenVINO_DIR={_openvino_cmake_dir()}", f"-DTBB_DIR={_openvino_cmake_dir()}"]
        ninja = _tool("ninja")
        if ninja:
            cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        steps = [cfg, [cmake, "--build", str(work), "-j", str(max(1, os.cpu_count() or 1))]]
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=not verbose, text=True, check=False)
            if proc.returncode != 0:
                tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()[-25:])
                raise PluginError(f"building the CPU extension failed ({' '.join(cmd[:2])} ...):\n{tail}")
        built = work / LIBRARY_NAME
        if not built.is_file():
            raise PluginError(f"the build finished but {built} is missing")
        tmp = out / f".{LIBRARY_NAME}.tmp"
        shutil.copy2(built, tmp)
        os.replace(tmp, lib)  # atomic: a reader never sees a half-written library
    return lib


def library_path() -> Path:
    """The extension library to load: ``$OV_KVCRUSH_PLUGIN``, or this checkout's build (built now if needed)."""
    env = os.environ.get("OV_KVCRUSH_PLUGIN")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ConfigError("OV_KVCRUSH_PLUGIN", env, "the path of a built libov_kvcrush_cpu.so")
        return path
    return build()


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64 = ctypes.c_int32, ctypes.c_int64
    p_i64 = ctypes.POINTER(ctypes.c_int64)
    p_f32 = ctypes.POINTER(ctypes.c_float)
    p_i32 = ctypes.POINTER(ctypes.c_int32)
    p_u8 = ctypes.POINTER(ctypes.c_uint8)
    sigs = {
        "ovkc_last_error": ([], ctypes.c_char_p),
        "ovkc_kernel_isa": ([], ctypes.c_char_p),
        "ovkc_bf16_products": ([], i32),
        "ovkc_set_bf16_products": ([i32], i32),
        "ovkc_measure_bf16_products": ([i32, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)], i32),
        "ovkc_take_step_error": ([i64, ctypes.c_char_p, i64], i64),
        "ovkc_pool_create": (
            [i32, i32, i32, i32, i32, i32, i64, i32, ctypes.c_char_p, p_i64, i32, ctypes.POINTER(ctypes.c_double)],
            i64,
        ),
        "ovkc_pool_free": ([i64], i64),
        "ovkc_pool_stats": ([i64, p_i64], i64),
        "ovkc_seq_create": ([i64], i64),
        "ovkc_seq_free": ([i64], i64),
        "ovkc_seq_reset": ([i64], i64),
        "ovkc_seq_truncate": ([i64, i64], i64),
        "ovkc_seq_set_prompt": ([i64, i64], i64),
        "ovkc_pool_held_prompt": ([i64, i64], i64),
        "ovkc_seq_scoring_pass": ([i64, i64, i64, i64], i64),
        "ovkc_seq_stats": ([i64, p_i64], i64),
        "ovkc_seq_head_tokens": ([i64, i32, p_i64, i64], i64),
        "ovkc_seq_read_head": ([i64, i32, i32, i64, p_i64, p_f32, p_f32, p_f32], i64),
        "ovkc_keep_indices": ([p_f32, i64, i64, i64, i64, p_i64], i64),
        "ovkc_pool_scores": ([p_f32, i64, i64, i32], i64),
        "ovkc_kvcrush_select": ([p_f32, i32, i64, i64, i64, i64, i64, i64, ctypes.c_char_p, p_i64], i64),
        "ovkc_kvcrush_trace": (
            [p_f32, i32, i64, i64, i64, i64, i64, ctypes.c_char_p, p_u8, p_u8, *[p_i64] * 6],
            i64,
        ),
        "ovkc_cluster_stats": ([i64, i32, i32, p_i64], i64),
        "ovkc_cluster_read": ([i64, i32, i32, i32, i64, p_i64], i64),
        "ovkc_kmeans": ([p_f32, i64, i32, i64, i64, i64, i64, i32, p_i32, p_f32, p_i64, p_i64], i64),
        "ovkc_seq_read_degrees": ([i64, i32, i32, i64, p_f32], i64),
        "ovkc_seq_method_counters": ([i64, ctypes.c_char_p, i64], i64),
        "ovkc_policy_names": ([ctypes.c_char_p, i64], i64),
        "ovkc_snapshot_fields": ([], i64),
        "ovkc_seq_snapshot_sizes": ([i64, i32, i32, p_i64], i64),
        "ovkc_seq_snapshot_read": ([i64, i32, i32, p_i64, p_i64, p_u8, p_i64, p_u8, *[p_f32] * 4], i64),
        "ovkc_seq_snapshot_write": ([i64, i32, i32, p_i64, p_i64, p_u8, p_i64, p_u8, *[p_f32] * 4], i64),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def load() -> ctypes.CDLL:
    """The library opened for its C API (the same handle OpenVINO gets from ``add_extension``)."""
    global _lib, _lib_path, _bf16
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                import openvino  # noqa: F401  (loads libopenvino/libtbb the library links against)

                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise PluginError(f"cannot load the CPU extension {path}: {exc}") from None
            _declare(lib)
            _bf16 = bf16_choice.choose(lib)  # before any prompt: how its bf16 kernel multiplies here
            _lib, _lib_path = lib, path
        return _lib


def loaded_path() -> Path:
    """Path of the library :func:`load` opened (OpenVINO must be given this same path)."""
    load()
    assert _lib_path is not None
    return _lib_path


def shared_core() -> Any:
    """The process's one ``openvino.Core``, with the extension added: every model of ours compiles
    on it, so the process holds one CPU plugin, created once and never destroyed.

    Why one: each ``Core`` creates its own CPU plugin, and each plugin instance gives the thread
    that creates it a new alternate signal stack (OpenVINO's ``SigAltStackSetup``, for AMX). On
    destruction it unmaps that stack, but restores the one it found only if its own is still
    current, so two Cores destroyed in the order they were made leave the thread's alternate
    stack pointing at unmapped memory. The next signal handled there (Python's SIGINT handler,
    faulthandler's) then kills the process, or writes its frame over whatever was mapped there
    since (in our test suite, a module's data, which crashed the garbage collector later).
    ``tests/test_plugin.py`` reproduces it with two plain Cores in a child process. openvino_genai's
    pipelines make plugins of their own: :mod:`ov_kvcrush.engines.signal_stack` covers those.
    """
    global _core
    path = loaded_path()
    with _lock:
        if _core is None:
            import openvino

            core = openvino.Core()
            core.add_extension(str(path))
            _core = core
        return _core


def kernel_isa() -> str:
    """The vector path the library was compiled with: ``avx512`` or ``scalar``."""
    return load().ovkc_kernel_isa().decode()


#: how the bf16 prompt kernel multiplies its bf16 operands (plugins/cpu/src/kernels.hpp)
BF16_PRODUCTS = bf16_choice.BF16_PRODUCTS


def bf16_products() -> str:
    """``dot`` (AVX512-BF16 dot products) or ``widened`` (each bf16 widened to f32, multiplied in
    f32 FMAs): the process's choice (:func:`bf16_choice`, unless :func:`set_bf16_products` changed it)."""
    return BF16_PRODUCTS[load().ovkc_bf16_products()]


def bf16_choice_made() -> bf16_choice.Bf16Choice:
    """How the library's bf16 products were chosen when it was loaded, and why
    (:mod:`ov_kvcrush.op.bf16_choice`: ``OVKC_BF16_PRODUCTS``, kept for this CPU, or measured)."""
    load()
    assert _bf16 is not None
    return _bf16


def set_bf16_products(products: str) -> str:
    """Use ``products`` from now on in this process (tests, A/B runs); returns the previous choice."""
    if products not in BF16_PRODUCTS:
        raise ConfigError("bf16_products", products, " or ".join(BF16_PRODUCTS))
    return BF16_PRODUCTS[load().ovkc_set_bf16_products(BF16_PRODUCTS.index(products))]


def check_result(result: int) -> int:
    """A C API call's result; a negative one raises :class:`PluginError` with the library's message."""
    if result < 0:
        raise PluginError(load().ovkc_last_error().decode() or "ov_kvcrush extension error")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ov_kvcrush.op.plugin", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["build", "path"], help="build: build if needed and print the path")
    p.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build exists")
    p.add_argument("--verbose", action="store_true", help="show the compiler output")
    args = p.parse_args(argv)
    try:
        path = build(force=args.force, verbose=args.verbose) if args.command == "build" else library_path()
        print(path)
        print("kernels:", kernel_isa())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
