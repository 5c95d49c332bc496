"""Conversation caches on disk: a kept cache written to a file, and read back after a restart.

**The file** is numpy's ``.npz`` (uncompressed): a zip of plain arrays, read without pickle
(``allow_pickle=False``), each member CRC-checked by ``zipfile``, readable by any numpy for
years. It holds the sequence's snapshot (:mod:`ov_kvcrush.op.snapshot`: raw blocks as the op
stores them, positions, scores), the token ids it holds (and whether it is a held prompt:
:mod:`ov_kvcrush.serving.kept`), a ``meta`` JSON (format version, the
model's identity, the pool's configuration: precision, block size, shape, windows, the
method's op spec) and a SHA-256 over the meta and every array. safetensors was the other
candidate; it holds tensors and a string map just as well, but is one more package where numpy
is already here, and a snapshot's byte arrays are no tensors. A snapshot is about the cache's
``kv_bytes`` (raw blocks, no compression: they are codes already), plus the ids and positions.

**Writes are atomic**: a temporary file in the same directory, flushed and synced, then renamed
over the final name (``os.replace``); a process killed mid-write leaves a temporary file, never
a half-written cache, and the temporaries are removed at the next start.

**Nothing wrong is ever reused**: a file that is truncated or corrupt (zip CRC, checksum), from
another format version, another model or another pool configuration is counted by reason,
deleted, and the request prefills cold.

:class:`DiskCaches` is one pool's directory of them: restore the file a request continues
furthest (as :class:`~ov_kvcrush.serving.kept.KeptCaches` does in memory), save a finished
request's cache (replacing its conversation's earlier turn), and evict least recently used past
a size budget. :func:`save_cache` / :func:`load_cache` are the same files for one chat
(``LLMPipeline.save_chat``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ov_kvcrush.engines.openvino_model import SequenceCache
from ov_kvcrush.errors import UserError
from ov_kvcrush.op.kvcache import KVPool, KVSequence
from ov_kvcrush.op.plugin import PluginError
from ov_kvcrush.op.snapshot import SequenceSnapshot, read_snapshot, write_snapshot
from ov_kvcrush.serving.kept import continued_prefix

#: the files' format; a file of another version is not read (2: a cache may be a held prompt,
#: ``holds_prompt``, whose ids are a prompt's earlier chunks; 3: a held prompt past its first
#: step is held where the next turn's cold request cuts it now, :func:`~ov_kvcrush.serving.kept.hold_point`)
FORMAT_VERSION = 3
SUFFIX = ".kvc.npz"
TEMP_PREFIX = ".tmp-"


class CacheFileError(Exception):
    """A file that must not be reused; ``reason`` is its metrics label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def model_identity(model_dir: Path) -> str:
    """A digest of the exported model: its config, its graph and its weights' size (hashing
    gigabytes of weights at every start would cost more than the caches save)."""
    h = hashlib.sha256()
    for name in ("config.json", "openvino_model.xml"):
        path = Path(model_dir) / name
        h.update(name.encode())
        h.update(path.read_bytes() if path.is_file() else b"")
    weights = Path(model_dir) / "openvino_model.bin"
    h.update(str(weights.stat().st_size if weights.is_file() else 0).encode())
    return h.hexdigest()


def pool_identity(pool: Any) -> dict[str, Any]:
    """What a snapshot's bytes depend on: the pool's layout and method (refused for a pool that
    is not the CPU op's: our GPU plugin layers' pool has no snapshots)."""
    if not isinstance(pool, KVPool):
        raise UserError("conversation caches on disk need the CPU op's pool (device CPU)")
    return {
        "shape": [pool.layers, pool.q_heads, pool.kv_heads, pool.head_dim],
        "block_size": pool.block_size,
        "precision": pool.precision,
        "scores": bool(pool.scores),
        "windows": list(pool.windows),
        "method": pool.method,
    }


def identity_of(model_dir: Path, pool: Any) -> dict[str, Any]:
    """The identity a file must carry to be restored into ``pool`` of the model at ``model_dir``."""
    return {"format": FORMAT_VERSION, "model": model_identity(model_dir), "pool": pool_identity(pool)}


def _checksum(meta: bytes, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(meta)
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))  # its bytes, not a copy of them
    return h.hexdigest()


def save_cache(path: Path, cache: SequenceCache | None, identity: dict[str, Any], extra: dict | None = None) -> int:
    """Write ``cache`` (not stepped meanwhile; ``None``: no cache, only ``extra``) to ``path``
    atomically; its size in bytes. ``extra``: JSON-able data carried beside it (a chat's messages)."""
    arrays: dict[str, np.ndarray] = {}
    if cache is not None:
        snap = read_snapshot(cache.sequence)
        arrays = {
            **snap.arrays(),
            "ids": np.asarray(cache.ids, dtype=np.int64),
            "scored": np.int64(cache.scored),
            "holds_prompt": np.bool_(cache.holds_prompt),
        }
    meta = json.dumps({**identity, "extra": extra or {}}, sort_keys=True).encode()
    arrays["meta"] = np.frombuffer(meta, dtype=np.uint8)
    arrays["checksum"] = np.frombuffer(_checksum(meta, arrays).encode(), dtype=np.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash of the machine
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
    return path.stat().st_size


def _read_members(path: Path, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {n: z[n] for n in (names or z.files)}
    except FileNotFoundError:
        raise  # gone (evicted by another process on the same directory): not a bad file
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise CacheFileError("corrupt", f"{path.name} cannot be read ({type(e).__name__}: {e})") from e


def _parse_meta(path: Path, meta_bytes: bytes) -> dict:
    """A file's meta, of this format version."""
    try:
        meta = json.loads(meta_bytes)
    except ValueError as e:
        raise CacheFileError("corrupt", f"{path.name}: its meta is not JSON") from e
    if meta.get("format") != FORMAT_VERSION:
        raise CacheFileError("version", f"{path.name} is of format {meta.get('format')}, not {FORMAT_VERSION}")
    return meta


def _check_meta(path: Path, meta: dict, identity: dict[str, Any]) -> None:
    """The meta's model and pool are ``identity``'s."""
    for key, reason in (("model", "model"), ("pool", "config")):
        if meta.get(key) != identity[key]:
            raise CacheFileError(reason, f"{path.name} was written for another {key}")


def read_meta(path: Path, identity: dict[str, Any]) -> tuple[list[int], dict]:
    """A file's ids and meta, its version and identity checked (the blocks are not read)."""
    members = _read_members(path, ("meta", "ids"))
    meta = _parse_meta(path, members["meta"].tobytes())
    _check_meta(path, meta, identity)
    return members["ids"].tolist(), meta


def read_file(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A file's meta and arrays, whole and of this format (its checksum checked), or
    :class:`CacheFileError`; whose model and pool it was written for is the caller's to check."""
    path = Path(path)
    members = _read_members(path)
    for name in ("meta", "checksum"):
        if name not in members:
            raise CacheFileError("corrupt", f"{path.name} has no {name}")
    meta_bytes = members["meta"].tobytes()
    meta = _parse_meta(path, meta_bytes)
    checksum = members.pop("checksum").tobytes().decode(errors="replace")
    if _checksum(meta_bytes, members) != checksum:
        raise CacheFileError("checksum", f"{path.name} fails its checksum")
    return meta, members


def restore_into(
    path: Path, meta: dict, members: dict[str, np.ndarray], sequence: KVSequence, identity: dict[str, Any]
) -> SequenceCache:
    """The cache a file holds (:func:`read_file`'s ``meta`` and ``members``) written into
    ``sequence`` (reset first), once its model and pool are ``identity``'s; else
    :class:`CacheFileError` and ``sequence`` is left reset."""
    _check_meta(Path(path), meta, identity)
    if "ids" not in members or "holds_prompt" not in members:
        raise CacheFileError("corrupt", f"{Path(path).name} holds no cache")
    fields = {n: members[n] for n in SequenceSnapshot.__dataclass_fields__ if n in members}
    try:
        write_snapshot(sequence, SequenceSnapshot(**fields))
    except (TypeError, ValueError) as e:
        raise CacheFileError("config", f"{Path(path).name} does not fit the pool ({e})") from e
    except PluginError as e:
        if "does not fit this pool" in str(e):
            raise CacheFileError("config", f"{Path(path).name} does not fit the pool ({e})") from e
        raise  # the pool is full: not the file's fault
    held = bool(members["holds_prompt"])
    return SequenceCache(sequence, members["ids"].tolist(), int(members["scored"]), holds_prompt=held)


def load_cache(path: Path, sequence: KVSequence, identity: dict[str, Any]) -> tuple[SequenceCache, dict]:
    """The cache of the file at ``path`` written into ``sequence`` (reset first), and the file's
    ``extra``; raises :class:`CacheFileError` (``sequence`` left reset) for a file that must not
    be reused."""
    meta, members = read_file(path)
    return restore_into(path, meta, members, sequence, identity), meta.get("extra", {})


class DiskCaches:
    """One pool's conversation caches in ``directory``, at most ``max_bytes`` of files (least
    recently used out). Safe to call from several threads; several processes may share the
    directory (Ray replicas of one configuration): every write is an atomic rename, and a file
    another one evicted is a miss, not a bad file."""

    def __init__(self, directory: Path, identity: dict[str, Any], max_bytes: int, min_shared: int = 64, slack: int = 4):
        self.directory = Path(directory)
        try:  # a directory that cannot take files is said at start, not at the first write
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(prefix=TEMP_PREFIX, dir=self.directory):
                pass
        except OSError as e:
            raise UserError(f"cache directory {self.directory} cannot hold files: {e}") from e
        self.identity = identity
        self.max_bytes = max_bytes
        self.min_shared, self.slack = min_shared, slack
        self.counts: Counter[str] = Counter()  # saved, restored, and rejected files by reason
        self._lock = threading.Lock()
        self._index: dict[Path, list[int]] = {}
        for tmp in self.directory.glob(TEMP_PREFIX + "*"):  # a write a crash cut short
            self._discard(tmp, "unfinished")
        for path in self.directory.glob("*" + SUFFIX):
            try:
                self._index[path] = read_meta(path, identity)[0]
            except CacheFileError as e:
                self._discard(path, e.reason)
            except FileNotFoundError:  # removed meanwhile by another process on the directory
                continue

    def _discard(self, path: Path, reason: str) -> None:
        self.counts[f"rejected_{reason}"] += 1
        with contextlib.suppress(OSError):
            path.unlink()

    def restore(self, ids: list[int], pool: KVPool) -> SequenceCache | None:
        """The cache on disk that ``ids`` continues furthest, in a new sequence of ``pool``
        (``None``: none, or a file that must not be reused: it is counted and deleted)."""
        with self._lock:
            best = max(
                self._index.items(),
                key=lambda kv: continued_prefix(kv[1], ids, self.min_shared, self.slack),
                default=None,
            )
            if best is None or not continued_prefix(best[1], ids, self.min_shared, self.slack):
                return None
            path = best[0]
        sequence = pool.new_sequence()
        try:
            cache, _ = load_cache(path, sequence, self.identity)
        except CacheFileError as e:
            sequence.free()
            with self._lock:
                self._index.pop(path, None)
            self._discard(path, e.reason)
            return None
        except FileNotFoundError:  # evicted meanwhile (another replica on the directory): a cold prefill
            sequence.free()
            with self._lock:
                self._index.pop(path, None)
            return None
        except (PluginError, OSError):  # a full pool, or the disk: a cold prefill, the file stays
            sequence.free()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used; the file stays until this conversation's next save
        self.counts["restored"] += 1
        return cache

    def save(self, cache: SequenceCache) -> None:
        """Write ``cache`` (a finished request's, before anyone takes it again), drop the files
        of its conversation's earlier turns, and evict past the size budget."""
        if not cache.ids:
            return
        path = self.directory / (hashlib.sha256(np.asarray(cache.ids, np.int64).tobytes()).hexdigest()[:24] + SUFFIX)
        save_cache(path, cache, self.identity)
        with self._lock:
            for old, ids in list(self._index.items()):
                if old != path and len(ids) <= len(cache.ids) and cache.ids[: len(ids)] == ids:
                    del self._index[old]
                    with contextlib.suppress(OSError):
                        old.unlink()
            self._index[path] = list(cache.ids)
            self.counts["saved"] += 1
            self._evict()

    def _evict(self) -> None:
        files = []
        for path in self._index:
            with contextlib.suppress(OSError):
                st = path.stat()
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            del self._index[path]
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size
            self.counts["evicted"] += 1

    def bytes_on_disk(self) -> int:
        with self._lock:
            paths = list(self._index)
        total = 0
        for path in paths:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def __len__(self) -> int:
        return len(self._index)


__all__ = ["CacheFileError", "DiskCaches", "identity_of", "load_cache", "model_identity", "save_cache"]
