"""A sequence's cache as arrays, and back: what a conversation kept on disk holds.

:func:`read_snapshot` copies, per (layer, KV head), the slots' positions and raw blocks (keys,
values and the u8 store's scales exactly as the op stores them), the 2-bit blocks, the scores,
Chelsea's degrees and biases, the pinned tail and the layer's tokens seen
(``plugins/cpu/src/snapshot.cpp``). :func:`write_snapshot` writes them into an empty sequence of
a pool configured the same way: the restored cache is the saved one byte for byte, so its next
step is the step the saved one would have taken. The arrays are a few per kind, the heads' parts
concatenated in (layer, head) order, so a file holds a handful of arrays whatever the model.
A method with state beside the slots (ClusterKV's clusters) is refused by name.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields

import numpy as np

from ov_kvcrush.op.kvcache import KVSequence, ptr
from ov_kvcrush.op.plugin import check_result

#: the per-head counts, in the library's order (snapshot.cpp's Field)
COUNTS = (
    "slots",
    "blocks",
    "qslots",
    "qblocks",
    "scores",
    "degree",
    "bias",
    "qscores",
    "holes",
    "pin_begin",
    "pin_count",
    "seen",
)


@dataclass
class SequenceSnapshot:
    """One sequence's cache: ``counts`` ``[layers * kv_heads, len(COUNTS)]``, then each kind's
    parts of every head, concatenated in (layer, head) order."""

    counts: np.ndarray
    pos: np.ndarray  # int64 [slots]
    blocks: np.ndarray  # uint8 [blocks * block bytes]
    qpos: np.ndarray  # int64 [qslots]
    qblocks: np.ndarray  # uint8 [qblocks * 2-bit block bytes]
    scores: np.ndarray  # float32
    degree: np.ndarray
    bias: np.ndarray
    qscores: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())


#: each part's array: (its count's column, its dtype, elements per count, given the pool's block bytes),
#: in the order the library's read and write take them
def _parts(block_bytes: int, qblock_bytes: int) -> dict[str, tuple[int, type, int]]:
    col = COUNTS.index
    return {
        "pos": (col("slots"), np.int64, 1),
        "blocks": (col("blocks"), np.uint8, block_bytes),
        "qpos": (col("qslots"), np.int64, 1),
        "qblocks": (col("qblocks"), np.uint8, qblock_bytes),
        "scores": (col("scores"), np.float32, 1),
        "degree": (col("degree"), np.float32, 1),
        "bias": (col("bias"), np.float32, 1),
        "qscores": (col("qscores"), np.float32, 1),
    }


_CTYPES = {np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint8): ctypes.c_uint8, np.dtype(np.float32): ctypes.c_float}


def _heads(seq: KVSequence) -> tuple[list[tuple[int, int]], dict[str, tuple[int, type, int]]]:
    """The sequence's (layer, KV head) pairs in snapshot order, and its pool's parts; refuses a
    library whose snapshot counts are not :data:`COUNTS`."""
    pool = seq.pool
    fields_there = check_result(pool.lib.ovkc_snapshot_fields())
    if fields_there != len(COUNTS):
        raise RuntimeError(f"the library's snapshot has {fields_there} counts, this module {len(COUNTS)}")
    heads = [(layer, g) for layer in range(pool.layers) for g in range(pool.kv_heads)]
    return heads, _parts(pool.block_bytes, pool.stats().qblock_bytes)


def _head_pointers(counts: np.ndarray, arrays: dict[str, np.ndarray], spec: dict[str, tuple[int, type, int]]):
    """Per head, pointers to its part of each array (``arrays`` in ``spec``'s order), as the
    library's read and write take them."""
    offsets = dict.fromkeys(spec, 0)
    for row in counts:
        pointers = []
        for name, (col, dt, per) in spec.items():
            n = int(row[col]) * per
            pointers.append(ptr(arrays[name][offsets[name] : offsets[name] + n], _CTYPES[np.dtype(dt)]))
            offsets[name] += n
        yield pointers


def read_snapshot(seq: KVSequence) -> SequenceSnapshot:
    """Copy ``seq``'s cache (it must not be stepped meanwhile: a finished request's, a chat's
    between turns)."""
    heads, spec = _heads(seq)
    lib = seq.pool.lib
    counts = np.zeros((len(heads), len(COUNTS)), dtype=np.int64)
    for i, (layer, g) in enumerate(heads):
        check_result(lib.ovkc_seq_snapshot_sizes(seq.handle, layer, g, ptr(counts[i], ctypes.c_int64)))
    out = {name: np.zeros(int(counts[:, col].sum()) * per, dtype=dt) for name, (col, dt, per) in spec.items()}
    for i, ((layer, g), pointers) in enumerate(zip(heads, _head_pointers(counts, out, spec), strict=True)):
        check_result(lib.ovkc_seq_snapshot_read(seq.handle, layer, g, ptr(counts[i], ctypes.c_int64), *pointers))
    return SequenceSnapshot(counts, **out)


def write_snapshot(seq: KVSequence, snap: SequenceSnapshot) -> None:
    """Write ``snap`` into ``seq`` (reset first; left reset when the snapshot does not fit its
    pool or the pool is exhausted, the error raised)."""
    heads, spec = _heads(seq)
    lib = seq.pool.lib
    counts = np.ascontiguousarray(snap.counts, dtype=np.int64)
    if counts.shape != (len(heads), len(COUNTS)):
        raise ValueError(f"the snapshot holds {counts.shape[0]} heads, the pool {len(heads)}")
    arrays = {name: np.ascontiguousarray(getattr(snap, name), dtype=dt) for name, (_, dt, _) in spec.items()}
    for name, (col, _, per) in spec.items():
        if arrays[name].size != int(counts[:, col].sum()) * per:
            raise ValueError(f"the snapshot's {name} hold {arrays[name].size} values, its counts say otherwise")
    seq.reset()
    try:
        for i, ((layer, g), pointers) in enumerate(zip(heads, _head_pointers(counts, arrays, spec), strict=True)):
            check_result(lib.ovkc_seq_snapshot_write(seq.handle, layer, g, ptr(counts[i], ctypes.c_int64), *pointers))
    except Exception:
        seq.reset()
        raise


__all__ = ["COUNTS", "SequenceSnapshot", "read_snapshot", "write_snapshot"]
