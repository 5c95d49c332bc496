"""The CPU extension library (``plugins/cpu``): build it, load it, and reach its KV cache.

The library holds the ``ov_kvcrush::PagedAttention`` op and the paged block cache it owns. It is
built with CMake against the OpenVINO runtime of the installed ``openvino`` wheel (headers and
``OpenVINOConfig.cmake`` ship with it), once per source version, OpenVINO version and machine,
into the user cache dir; ``make setup`` builds it, and :func:`library_path` builds it on first use
otherwise. ``OV_KVCRUSH_PLUGIN=/path/libov_kvcrush_cpu.so`` uses a library built elsewhere.

The same library is opened twice in the process: by OpenVINO (``core.add_extension``), which
runs the op, and by :mod:`ctypes` here, which calls its C API. ``dlopen`` of one path returns
one handle, so both see the same registry of pools and sequences:

* :class:`KVPool`: one pipeline's block store (block size, KV precision, an optional block limit);
* :class:`KVSequence`: one sequence's per-layer, per-head block tables; its handle is the value
  the model's ``kvc_sequence`` input takes.

``python -m ov_kvcrush.plugin build`` builds (or finds) the library and prints its path.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ov_kvcrush.errors import ConfigError, UserError

LIBRARY_NAME = "libov_kvcrush_cpu.so"
#: KV precisions the op's cache stores, as the C API numbers them.
PRECISIONS = {"f32": 0, "f16": 1}
#: Element size of each precision, in bytes.
PRECISION_BYTES = {"f32": 4, "f16": 2}


def block_bytes(block_size: int, head_dim: int, precision: str) -> int:
    """Bytes of one block (keys and values of ``block_size`` tokens of one KV head), as the pool allocates."""
    return 2 * block_size * head_dim * PRECISION_BYTES[precision]


DEFAULT_BLOCK_SIZE = 32

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None


class PluginError(UserError):
    """The extension library could not be built or loaded, or its C API reported an error."""


def source_dir() -> Path:
    """``plugins/cpu`` of the source tree (an editable install), or the copy shipped in the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "plugins" / "cpu", here / "plugins" / "cpu"):
        if (candidate / "CMakeLists.txt").is_file():
            return candidate
    raise PluginError(f"the C++ sources of the CPU extension (plugins/cpu) are not found next to {here}")


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
    from ov_kvcrush.export import cache_root

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
    sigs = {
        "ovkc_last_error": ([], ctypes.c_char_p),
        "ovkc_kernel_isa": ([], ctypes.c_char_p),
        "ovkc_pool_create": ([i32, i32, i32, i32, i32, i32, i64, i32, ctypes.c_char_p], i64),
        "ovkc_pool_free": ([i64], i64),
        "ovkc_pool_stats": ([i64, p_i64], i64),
        "ovkc_seq_create": ([i64], i64),
        "ovkc_seq_free": ([i64], i64),
        "ovkc_seq_reset": ([i64], i64),
        "ovkc_seq_truncate": ([i64, i64], i64),
        "ovkc_seq_stats": ([i64, p_i64], i64),
        "ovkc_seq_head_tokens": ([i64, i32, p_i64, i64], i64),
        "ovkc_seq_read_head": ([i64, i32, i32, i64, p_i64, p_f32, p_f32, p_f32], i64),
        "ovkc_keep_indices": ([p_f32, i64, i64, i64, i64, p_i64], i64),
        "ovkc_pool_scores": ([p_f32, i64, i64, i32], i64),
        "ovkc_kvcrush_select": ([p_f32, i32, i64, i64, i64, i64, i64, i64, ctypes.c_char_p, p_i64], i64),
        "ovkc_cluster_stats": ([i64, i32, i32, p_i64], i64),
        "ovkc_cluster_read": ([i64, i32, i32, i32, i64, p_i64], i64),
        "ovkc_kmeans": ([p_f32, i64, i32, i64, i64, i64, i64, i32, p_i32, p_f32, p_i64, p_i64], i64),
        "ovkc_seq_read_degrees": ([i64, i32, i32, i64, p_f32], i64),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def load() -> ctypes.CDLL:
    """The library opened for its C API (the same handle OpenVINO gets from ``add_extension``)."""
    global _lib, _lib_path
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                import openvino  # noqa: F401  (loads libopenvino/libtbb the library links against)

                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise PluginError(f"cannot load the CPU extension {path}: {exc}") from None
            _declare(lib)
            _lib, _lib_path = lib, path
        return _lib


def loaded_path() -> Path:
    """Path of the library :func:`load` opened (OpenVINO must be given this same path)."""
    load()
    assert _lib_path is not None
    return _lib_path


def kernel_isa() -> str:
    """The vector path the library was compiled with: ``avx512`` or ``scalar``."""
    return load().ovkc_kernel_isa().decode()


def _check(result: int) -> int:
    if result < 0:
        raise PluginError(load().ovkc_last_error().decode() or "ov_kvcrush extension error")
    return result


@dataclass(frozen=True)
class PoolStats:
    """Block store occupancy: ``kv_bytes`` is the bytes of the blocks in use (full-precision K/V
    blocks and MiniKV's 2-bit blocks)."""

    blocks_in_use: int
    blocks_allocated: int
    peak_blocks: int
    block_bytes: int
    sequences: int
    qblocks_in_use: int = 0
    qblock_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.blocks_in_use * self.block_bytes + self.qblocks_in_use * self.qblock_bytes


@dataclass(frozen=True)
class SequenceStats:
    """One sequence: blocks it holds (all layers and KV heads), tokens seen, tokens held, and the
    bytes of its blocks (``kv_bytes``: full-precision blocks and 2-bit blocks)."""

    blocks_held: int
    tokens_seen: int
    tokens_held: int
    kv_bytes: int
    qblocks_held: int
    #: ns in the method's own work (selection, eviction, merging, 2-bit flush): prefill, decode steps
    policy_prefill_ns: int
    policy_decode_ns: int
    #: ns in the per-head score pass (the attention probabilities eviction ranks by)
    scores_prefill_ns: int
    scores_decode_ns: int
    block_bytes: int


@dataclass(frozen=True)
class ClusterStats:
    """ClusterKV's state of one (layer, KV head) in the op (all zero where it has none: other
    methods, dense layers).

    ``lookups``/``hits``/``tokens_loaded`` count as the reference does (a recalled cluster is a
    hit when it was recalled within the last ``recall_cache_steps`` steps); ``gathered`` is the
    tokens the op actually copied into its working set (misses, sinks, pending tokens, and slabs
    reloaded because their tokens went into the 2-bit store).
    """

    clusters: int
    steps: int
    clusterings: int
    kmeans_iterations: int
    lookups: int
    hits: int
    tokens_loaded: int
    gathered: int
    pending_from: int
    sinks: int
    working_set_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class KMeansResult:
    """The op's k-means of one head: what the tests compare with the reference (and brute force)."""

    labels: np.ndarray  #: [n] int32
    centroids: np.ndarray  #: [min(k, n), d]: the plain mean of each cluster's vectors
    sizes: np.ndarray  #: [min(k, n)] int64
    iterations: int
    #: rows whose similarities were computed, summed over the iterations (the bounds skip the rest)
    rows_assigned: int


def kmeans(
    x: np.ndarray, k: int, *, max_iters: int = 20, seed: int = 0, row: int = 0, bounded: bool = True
) -> KMeansResult:
    """The op's ``kmeans_cosine`` of ``x`` ``[n, d]`` as batch row ``row``.

    ``bounded=False`` recomputes every similarity at every iteration: the brute-force oracle the
    bounded assignment must equal exactly.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    kk = min(k, n)
    labels = np.zeros(n, dtype=np.int32)
    centroids = np.zeros((kk, d), dtype=np.float32)
    sizes = np.zeros(kk, dtype=np.int64)
    assigned = np.zeros(1, dtype=np.int64)
    it = _check(
        load().ovkc_kmeans(
            _ptr(x, ctypes.c_float),
            n,
            d,
            k,
            max_iters,
            seed,
            row,
            int(bounded),
            _ptr(labels, ctypes.c_int32),
            _ptr(centroids, ctypes.c_float),
            _ptr(sizes, ctypes.c_int64),
            _ptr(assigned, ctypes.c_int64),
        )
    )
    return KMeansResult(labels, centroids, sizes, it, int(assigned[0]))


class KVPool:
    """A block store for one model: every sequence of a pipeline takes its blocks from here.

    Args:
        layers, q_heads, kv_heads, head_dim: the model's attention shape.
        block_size: tokens per block (a multiple of 16).
        precision: ``f32`` or ``f16`` storage of keys and values.
        max_blocks: refuse to grow past this many blocks (0: no limit); a sequence that needs
            more fails with an error naming the limit.
        scores: accumulate per-head attention scores (the eviction policies read them).
        method: the compression method spec (:func:`ov_kvcrush.policy.method_spec` builds it from
            a :class:`~ov_kvcrush.config.CompressionConfig`); empty: the full cache.
    """

    def __init__(
        self,
        layers: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        precision: str = "f32",
        max_blocks: int = 0,
        scores: bool = False,
        method: str = "",
    ) -> None:
        if precision not in PRECISIONS:
            raise ConfigError("kv_precision", precision, "one of " + ", ".join(PRECISIONS))
        self.lib = load()
        self.layers, self.q_heads, self.kv_heads, self.head_dim = layers, q_heads, kv_heads, head_dim
        self.block_size, self.precision, self.scores, self.method = block_size, precision, scores, method
        self.handle = _check(
            self.lib.ovkc_pool_create(
                layers,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                PRECISIONS[precision],
                max_blocks,
                int(scores),
                method.encode(),
            )
        )
        #: bytes per block as the library allocates them (read once: it never changes)
        self.block_bytes = self.stats().block_bytes

    def new_sequence(self) -> KVSequence:
        return KVSequence(self)

    def stats(self) -> PoolStats:
        buf = (ctypes.c_int64 * 7)()
        _check(self.lib.ovkc_pool_stats(self.handle, buf))
        return PoolStats(*[int(x) for x in buf])

    def close(self) -> None:
        """Free the pool and every sequence still using it (idempotent)."""
        if getattr(self, "handle", 0) > 0:
            self.lib.ovkc_pool_free(self.handle)
            self.handle = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class KVSequence:
    """One sequence's cache in a :class:`KVPool`; ``handle`` is what the model's ``kvc_sequence`` input takes."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.handle = _check(pool.lib.ovkc_seq_create(pool.handle))

    def reset(self) -> None:
        """Return every block to the pool; the next step starts a new sequence at position 0."""
        _check(self.pool.lib.ovkc_seq_reset(self.handle))

    def truncate(self, tokens: int) -> None:
        """Forget every token at position ``tokens`` or later (chat: roll back to a common prefix)."""
        if tokens < 0:
            raise ConfigError("tokens", tokens, "an integer >= 0")
        _check(self.pool.lib.ovkc_seq_truncate(self.handle, tokens))

    def free(self) -> None:
        """Release the sequence and its blocks (idempotent)."""
        if self.handle > 0 and self.pool.handle > 0:
            self.pool.lib.ovkc_seq_free(self.handle)
        self.handle = 0

    def stats(self) -> SequenceStats:
        buf = (ctypes.c_int64 * 9)()
        _check(self.pool.lib.ovkc_seq_stats(self.handle, buf))
        return SequenceStats(*[int(x) for x in buf], self.pool.block_bytes)

    def head_tokens(self) -> np.ndarray:
        """Tokens held per layer and KV head, ``[layers, kv_heads]``."""
        return self._per_head(0)

    def head_holes(self) -> np.ndarray:
        """Holes per layer and KV head, ``[layers, kv_heads]``: tokens a decode step evicted whose
        slots still occupy blocks until a block's worth has gathered and the head is compacted
        (fewer than ``block_size`` per head; attention skips them, ``head_tokens`` excludes them)."""
        return self._per_head(1)

    def _per_head(self, what: int) -> np.ndarray:
        out = np.zeros(self.pool.layers * self.pool.kv_heads, dtype=np.int64)
        _check(self.pool.lib.ovkc_seq_head_tokens(self.handle, what, _ptr(out, ctypes.c_int64), out.size))
        return out.reshape(self.pool.layers, self.pool.kv_heads)

    def read_head(self, layer: int, kv_head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(positions [n], keys [n, d], values [n, d], scores [n, group])`` held by one head."""
        n = int(self.head_tokens()[layer, kv_head]) if 0 <= layer < self.pool.layers else 0
        d, g = self.pool.head_dim, self.pool.q_heads // self.pool.kv_heads
        pos = np.zeros(n, dtype=np.int64)
        keys = np.zeros((n, d), dtype=np.float32)
        values = np.zeros((n, d), dtype=np.float32)
        scores = np.zeros((n, g), dtype=np.float32)
        _check(
            self.pool.lib.ovkc_seq_read_head(
                self.handle,
                layer,
                kv_head,
                n,
                _ptr(pos, ctypes.c_int64),
                _ptr(keys, ctypes.c_float),
                _ptr(values, ctypes.c_float),
                _ptr(scores, ctypes.c_float),
            )
        )
        return pos, keys, values, scores

    def read_degrees(self, layer: int, kv_head: int) -> np.ndarray:
        """Chelsea: how many original tokens each held token of one head stands for (slot order, as
        :meth:`read_head` lists the full-precision tokens; all 1 where nothing was merged)."""
        out = np.zeros(max(int(self.head_tokens()[layer, kv_head]), 1), dtype=np.float32)
        lib = self.pool.lib
        n = _check(lib.ovkc_seq_read_degrees(self.handle, layer, kv_head, out.size, _ptr(out, ctypes.c_float)))
        return out[:n]

    def cluster_stats(self, layer: int, kv_head: int) -> ClusterStats:
        """ClusterKV's counters of one head (zeros where it keeps no cluster state)."""
        buf = (ctypes.c_int64 * 11)()
        _check(self.pool.lib.ovkc_cluster_stats(self.handle, layer, kv_head, buf))
        return ClusterStats(*[int(x) for x in buf])

    def recalled(self, layer: int, kv_head: int) -> np.ndarray:
        """Positions ClusterKV's last decode step attended in this head (ascending; empty if none)."""
        return self._cluster_read(layer, kv_head, 0, int(self.head_tokens()[layer, kv_head]))

    def cluster_labels(self, layer: int, kv_head: int) -> np.ndarray:
        """Cluster of each clustered token (from the first token after the sinks), as ClusterKV's op holds them."""
        return self._cluster_read(layer, kv_head, 1, int(self.head_tokens()[layer, kv_head]))

    def _cluster_read(self, layer: int, kv_head: int, what: int, cap: int) -> np.ndarray:
        out = np.zeros(max(cap, 1), dtype=np.int64)
        lib = self.pool.lib
        n = _check(lib.ovkc_cluster_read(self.handle, layer, kv_head, what, out.size, _ptr(out, ctypes.c_int64)))
        return out[:n]

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m ov_kvcrush.plugin", description=__doc__.splitlines()[0])
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
