"""The op's paged KV cache, reached through the extension's C API (:mod:`ov_kvcrush.op.plugin` loads it).

* :class:`KVPool`: one pipeline's block store (block size, KV precision, an optional block limit,
  the compression method);
* :class:`KVSequence`: one sequence's per-layer, per-head block tables; its handle is the value
  the model's ``kvc_sequence`` input takes;
* the op's statistics, its k-means and the method's counters, for engines and tests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ov_kvcrush.config import SparsePrefill
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.op.plugin import check_result, load
from ov_kvcrush.validation import check_int

#: KV precisions the op's cache stores, as the C API numbers them: ``u8`` keeps 8-bit codes with a
#: per-token (per head) minimum and scale for keys and for values, as OpenVINO's CPU plugin does.
PRECISIONS = {"f32": 0, "f16": 1, "u8": 2}
#: Element size of each precision, in bytes (a code, for u8).
PRECISION_BYTES = {"f32": 4, "f16": 2, "u8": 1}
#: Per-token bytes beside the codes: u8's key and value minimum and scale (f32 each).
PRECISION_TOKEN_BYTES = {"f32": 0, "f16": 0, "u8": 16}


def take_step_error(handle: int) -> str:
    """The error our op raised in the last inference that stepped sequence ``handle`` ("" for
    none), cleared by reading it."""
    buf = ctypes.create_string_buffer(STEP_ERROR_BYTES)  # one call: reading takes it
    size = check_result(load().ovkc_take_step_error(int(handle), buf, len(buf)))
    return buf.value.decode(errors="replace") + (" ..." if size >= len(buf) else "")


def infer_steps(request: Any, inputs: Mapping[str, Any], handles: Iterable[int]) -> Any:
    """``request.infer(inputs)`` stepping the sequences ``handles``, raising our op's error.

    The op does not throw: OpenVINO drops a custom op's exception when it infers on one thread
    (``INFERENCE_NUM_THREADS=1``, or a process on one core), and its executor then runs a later
    step twice or not at all. It keeps its error for each sequence of the step (under 0 when the
    handles themselves could not be read) and ends the step with a zero output; this reads the
    errors after the inference and raises the first, as the line that says what went wrong.
    Every inference of a model with our op goes through here (a bare ``request.infer`` would not
    see the error).
    """
    keys = [*dict.fromkeys(int(h) for h in handles), 0]
    for h in keys:  # nothing stale from an earlier step whose errors were not read
        take_step_error(h)
    result = request.infer(inputs)
    errors = [e for e in (take_step_error(h) for h in keys) if e]
    if errors:
        lines = [ln.strip() for ln in errors[0].splitlines() if ln.strip()]
        raise RuntimeError(next((ln for ln in lines if "ov_kvcrush" in ln), lines[-1] if lines else errors[0]))
    return result


def block_bytes(block_size: int, head_dim: int, precision: str) -> int:
    """Bytes of one block (keys and values of ``block_size`` tokens of one KV head), as the pool allocates."""
    return block_size * (2 * head_dim * PRECISION_BYTES[precision] + PRECISION_TOKEN_BYTES[precision])


def pool_blocks(pool_bytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` a pool of ``pool_bytes`` holds (at least one)."""
    return max(1, int(pool_bytes // block_bytes))


DEFAULT_BLOCK_SIZE = 32
#: the longest op error read whole (longer ones are cut, marked "...")
STEP_ERROR_BYTES = 8192


def full_cache_spec(layers: int) -> str:
    """The full cache's spec, as :func:`ov_kvcrush.op.method_spec.method_spec` writes it for ``full``."""
    return "method=full;budgets=" + ",".join(["0"] * max(layers, 1)) + ";quant=0"


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
    #: ns in the steps' cache writes (keys and values into blocks) and in their attention
    append_prefill_ns: int
    append_decode_ns: int
    attend_prefill_ns: int
    attend_decode_ns: int
    #: the sparse prefill (:class:`~ov_kvcrush.config.SparsePrefill`): key blocks its
    #: prompts attended, the causal blocks dense prompts attend (over layers and query heads), and
    #: the ns its block estimate took (part of ``attend_prefill_ns``); zeros when off
    prefill_blocks_attended: int
    prefill_blocks_dense: int
    sparse_estimate_ns: int
    block_bytes: int

    @property
    def prefill_density(self) -> float:
        """The share of a dense prompt's key blocks the sparse prefill attended (1.0 when off)."""
        return self.prefill_blocks_attended / self.prefill_blocks_dense if self.prefill_blocks_dense else 1.0


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
    it = check_result(
        load().ovkc_kmeans(
            ptr(x, ctypes.c_float),
            n,
            d,
            k,
            max_iters,
            seed,
            row,
            int(bounded),
            ptr(labels, ctypes.c_int32),
            ptr(centroids, ctypes.c_float),
            ptr(sizes, ctypes.c_int64),
            ptr(assigned, ctypes.c_int64),
        )
    )
    return KMeansResult(labels, centroids, sizes, it, int(assigned[0]))


class KVPool:
    """A block store for one model: every sequence of a pipeline takes its blocks from here.

    Args:
        layers, q_heads, kv_heads, head_dim: the model's attention shape.
        block_size: tokens per block (a multiple of 16).
        precision: ``f32``, ``f16`` or ``u8`` storage of keys and values.
        max_blocks: refuse to grow past this many blocks' bytes (0: no limit), 2-bit blocks
            counted by their bytes; a sequence that needs more fails with an error naming the limit.
        scores: accumulate per-head attention scores (the eviction policies read them).
        method: the compression method spec (:func:`ov_kvcrush.op.method_spec.method_spec` builds it
            from a method config); ``None``: the full cache.
        windows: per layer, the sliding-window span of a local layer (0: a global layer);
            ``None``: every layer is global. Local layers keep their window as a ring of blocks
            and the method runs on the global layers only.
        count_only: a byte probe's pool (:mod:`ov_kvcrush.op.probe`): the method keeps, selects and
            quantizes as usual, but the op computes no attention and no scores (outputs are zero),
            so a probe of a long prompt costs its copies, not its attention.
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
        method: str | None = None,
        windows: list[int] | None = None,
        count_only: bool = False,
        sparse_prefill: SparsePrefill | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ConfigError("kv_precision", precision, "one of " + ", ".join(PRECISIONS))
        self.lib = load()
        self.layers, self.q_heads, self.kv_heads, self.head_dim = layers, q_heads, kv_heads, head_dim
        method = full_cache_spec(layers) if method is None else method
        self.block_size, self.precision, self.scores, self.method = block_size, precision, scores, method
        if windows is not None and len(windows) != layers:
            raise ConfigError("windows", windows, f"one sliding-window span per layer ({layers}; 0: a global layer)")
        #: per layer, the sliding-window span of a local layer (0: global), as the op keeps it
        self.windows = [int(w) for w in windows] if windows is not None else [0] * layers
        win = np.asarray(self.windows, dtype=np.int64)
        #: sparse prompt attention (None: dense)
        self.sparse_prefill = sparse_prefill
        sp = sparse_prefill
        fields = () if sp is None else (sp.block_size, sp.stride, sp.threshold, sp.last_dense_tokens, sp.dense_layers)
        sparse = (ctypes.c_double * 5)(*fields) if fields else None
        self.handle = check_result(
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
                ptr(win, ctypes.c_int64),
                int(count_only),
                sparse,
            )
        )
        #: bytes per block as the library allocates them (read once: it never changes)
        self.block_bytes = self.stats().block_bytes

    #: its sequences' caches can be copied out and written back (:mod:`ov_kvcrush.op.snapshot`)
    snapshots = True

    def new_sequence(self) -> KVSequence:
        return KVSequence(self)

    def held_prompt_tokens(self, tokens: int) -> int:
        """How many of a ``tokens``-token prompt's first tokens a held prompt keeps: fed as its
        first chunk (:meth:`KVSequence.set_prompt`), they leave the sequence as the same chunk of
        any longer prompt would, so a snapshot taken there continues a later turn exactly as that
        turn's history sent cold (cut there) runs. Past it, the rows a scoring window counts
        (SnapKV's) or the sparse prefill's dense last rows depend on where the prompt ends. 0: none."""
        check_int("tokens", tokens, 0, 1 << 40)
        return check_result(self.lib.ovkc_pool_held_prompt(self.handle, tokens))

    def scoring_room(self, step: int) -> int:
        """Slots per head a scoring step (KVzip's) of ``step`` tokens needs beside the sequence:
        its own (the op attends the held tokens in place)."""
        return step

    def stats(self) -> PoolStats:
        buf = (ctypes.c_int64 * 7)()
        check_result(self.lib.ovkc_pool_stats(self.handle, buf))
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

    #: a step of several tokens may follow the prompt (a chat's next turn over the kept cache)
    several_tokens_after_prompt = True

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.handle = check_result(pool.lib.ovkc_seq_create(pool.handle))

    def reset(self) -> None:
        """Return every block to the pool; the next step starts a new sequence at position 0."""
        check_result(self.pool.lib.ovkc_seq_reset(self.handle))

    def truncate(self, tokens: int) -> None:
        """Forget every token at position ``tokens`` or later (chat: roll back to a common prefix)."""
        if tokens < 0:
            raise ConfigError("tokens", tokens, "an integer >= 0")
        check_result(self.pool.lib.ovkc_seq_truncate(self.handle, tokens))

    def set_prompt(self, tokens: int) -> None:
        """The next steps prefill a prompt of ``tokens`` tokens in chunks.

        Each chunk attends and adds its scores; the method's prompt selection (and the 2-bit flush)
        runs once, on the last chunk, over the whole prompt, as when the prompt comes in one step.
        The sequence is empty, or holds a held prompt's earlier chunks (a snapshot taken inside a
        chunked prompt, restored: every token it has seen, unselected; ``tokens`` counts them).
        ``0``: prompts come whole. :meth:`reset` and :meth:`truncate` clear it.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ConfigError("tokens", tokens, "an integer >= 0")
        check_result(self.pool.lib.ovkc_seq_set_prompt(self.handle, tokens))

    def score_positions(self, lo: int, hi: int) -> None:
        """Start (or move on) the method's scoring pass (KVzip): until :meth:`end_scoring_pass`,
        each step attends what is held plus itself, scores the held tokens at positions
        ``[lo, hi)`` and is dropped again. The sequence must hold a prompt; a method without a
        scoring pass refuses, by name."""
        check_result(self.pool.lib.ovkc_seq_scoring_pass(self.handle, 1, lo, hi))

    def end_scoring_pass(self, select: bool = True) -> None:
        """End the scoring pass: the method's selection over every layer (``select``), or none
        (an interrupted pass leaves the cache as it was, scores aside)."""
        check_result(self.pool.lib.ovkc_seq_scoring_pass(self.handle, 2 if select else 0, 0, 0))

    def free(self) -> None:
        """Release the sequence and its blocks (idempotent)."""
        if self.handle > 0 and self.pool.handle > 0:
            self.pool.lib.ovkc_seq_free(self.handle)
        self.handle = 0

    def stats(self) -> SequenceStats:
        buf = (ctypes.c_int64 * 16)()
        check_result(self.pool.lib.ovkc_seq_stats(self.handle, buf))
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
        check_result(self.pool.lib.ovkc_seq_head_tokens(self.handle, what, ptr(out, ctypes.c_int64), out.size))
        return out.reshape(self.pool.layers, self.pool.kv_heads)

    def read_head(self, layer: int, kv_head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(positions [n], keys [n, d], values [n, d], scores [n, group])`` held by one head."""
        n = int(self.head_tokens()[layer, kv_head]) if 0 <= layer < self.pool.layers else 0
        d, g = self.pool.head_dim, self.pool.q_heads // self.pool.kv_heads
        pos = np.zeros(n, dtype=np.int64)
        keys = np.zeros((n, d), dtype=np.float32)
        values = np.zeros((n, d), dtype=np.float32)
        scores = np.zeros((n, g), dtype=np.float32)
        check_result(
            self.pool.lib.ovkc_seq_read_head(
                self.handle,
                layer,
                kv_head,
                n,
                ptr(pos, ctypes.c_int64),
                ptr(keys, ctypes.c_float),
                ptr(values, ctypes.c_float),
                ptr(scores, ctypes.c_float),
            )
        )
        return pos, keys, values, scores

    def read_degrees(self, layer: int, kv_head: int) -> np.ndarray:
        """Chelsea: how many original tokens each held token of one head stands for (slot order, as
        :meth:`read_head` lists the full-precision tokens; all 1 where nothing was merged)."""
        out = np.zeros(max(int(self.head_tokens()[layer, kv_head]), 1), dtype=np.float32)
        lib = self.pool.lib
        n = check_result(lib.ovkc_seq_read_degrees(self.handle, layer, kv_head, out.size, ptr(out, ctypes.c_float)))
        return out[:n]

    def cluster_stats(self, layer: int, kv_head: int) -> ClusterStats:
        """ClusterKV's counters of one head (zeros where it keeps no cluster state)."""
        buf = (ctypes.c_int64 * 11)()
        check_result(self.pool.lib.ovkc_cluster_stats(self.handle, layer, kv_head, buf))
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
        n = check_result(lib.ovkc_cluster_read(self.handle, layer, kv_head, what, out.size, ptr(out, ctypes.c_int64)))
        return out[:n]

    def method_counters(self) -> dict[str, float]:
        """The method's own counters (summed over layers and heads; e.g. ClusterKV's recall cache),
        as its policy in the op reports them: engines pass them on without knowing the method."""
        buf = ctypes.create_string_buffer(4096)
        n = check_result(self.pool.lib.ovkc_seq_method_counters(self.handle, buf, len(buf)))
        text = buf.value[:n].decode()
        return {k: float(v) for k, v in (item.split("=", 1) for item in text.split(";") if item)}

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass


def policy_names() -> list[str]:
    """The methods the op's policy table runs (sorted)."""
    buf = ctypes.create_string_buffer(1024)
    n = check_result(load().ovkc_policy_names(buf, len(buf)))
    return buf.value[:n].decode().split(",")


def ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))
