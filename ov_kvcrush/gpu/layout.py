"""The CPU op's block layout (``plugins/cpu/src/paged_cache.hpp``) in numpy: the bytes a GPU
pool holds, so that the OpenCL kernels read exactly what the CPU op writes.

A block is ``block_size`` tokens of one KV head: keys transposed ``[head_dim][block_size]``, then
values ``[block_size][head_dim]``, in f32, f16, or u8 codes followed by four rows of
``block_size`` floats (key min, key scale, value min, value scale; ``x = min + code * scale``,
OpenVINO's CPU KV-cache format). A pool is one buffer of equal blocks, indexed by block id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ov_kvcrush.validation import check_choice, check_int

PRECISIONS = ("f32", "f16", "u8")


@dataclass(frozen=True)
class PoolShape:
    """What a kernel is compiled for: the block layout and the query group."""

    precision: str
    block_size: int
    head_dim: int
    group: int = 1
    #: the model's attention soft-capping (Gemma 2's ``cap * tanh(s / cap)`` of each scaled
    #: logit, in every kernel that attends or scores); 0: none
    softcap: float = 0.0

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        check_int("block_size", self.block_size, 1, 1 << 12)
        check_int("head_dim", self.head_dim, 8, 1024)
        check_int("group", self.group, 1, 64)
        if not (self.softcap >= 0.0 and np.isfinite(self.softcap)):
            raise ValueError(f"softcap {self.softcap!r}: allowed 0 (none) or a positive number")

    @property
    def elem_bytes(self) -> int:
        return {"f32": 4, "f16": 2, "u8": 1}[self.precision]

    @property
    def block_bytes(self) -> int:
        params = 16 * self.block_size if self.precision == "u8" else 0
        return 2 * self.block_size * self.head_dim * self.elem_bytes + params

    def constants(self) -> dict[str, int | str]:
        capped: dict[str, int | str] = {"SOFTCAP": f"{float(self.softcap)!r}f"} if self.softcap else {}
        return {
            "KV_PRECISION": PRECISIONS.index(self.precision),
            "BLOCK_SIZE": self.block_size,
            "HEAD_DIM": self.head_dim,
            "GROUP": self.group,
        } | capped


def quantize_u8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row u8 codes, min and scale of ``x`` ``[n, D]`` as the CPU op's ``quantize_u8``
    (round half to even, codes clamped to 0..255)."""
    x = x.astype(np.float32)
    lo = x.min(axis=1)
    scale = ((x.max(axis=1) - lo) / np.float32(255.0)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1.0) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    codes = np.clip(np.rint((x - lo[:, None]) * inv[:, None]), 0, 255).astype(np.uint8)
    return codes, lo, scale


def dequantize_u8(codes: np.ndarray, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return lo[:, None] + codes.astype(np.float32) * scale[:, None]


def pack_block(shape: PoolShape, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The bytes of one block holding ``k``, ``v`` ``[t, D]`` (``t <= block_size``; the rest zero)."""
    bs, d = shape.block_size, shape.head_dim
    t = k.shape[0]
    if shape.precision == "u8":
        kc, kmin, kscale = quantize_u8(k)
        vc, vmin, vscale = quantize_u8(v)
        keys = np.zeros((d, bs), np.uint8)
        values = np.zeros((bs, d), np.uint8)
        keys[:, :t], values[:t] = kc.T, vc
        params = np.zeros((4, bs), np.float32)
        params[0, :t], params[1, :t], params[2, :t], params[3, :t] = kmin, kscale, vmin, vscale
        return np.concatenate([keys.ravel(), values.ravel(), params.ravel().view(np.uint8)])
    dtype = np.float32 if shape.precision == "f32" else np.float16
    keys = np.zeros((d, bs), dtype)
    values = np.zeros((bs, d), dtype)
    keys[:, :t], values[:t] = k.T, v
    return np.concatenate([keys.ravel().view(np.uint8), values.ravel().view(np.uint8)])


def unpack_block(shape: PoolShape, data: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``t`` tokens (keys, values ``[t, D]``, as floats) of one block's bytes."""
    bs, d = shape.block_size, shape.head_dim
    if shape.precision == "u8":
        keys = data[: d * bs].reshape(d, bs)[:, :t].T
        values = data[d * bs : 2 * d * bs].reshape(bs, d)[:t]
        params = data[2 * d * bs :].view(np.float32).reshape(4, bs)[:, :t]
        return dequantize_u8(keys, params[0], params[1]), dequantize_u8(values, params[2], params[3])
    dtype = np.float32 if shape.precision == "f32" else np.float16
    elems = data[: 2 * d * bs * shape.elem_bytes].view(dtype)
    keys = elems[: d * bs].reshape(d, bs)[:, :t].T
    return keys.astype(np.float32), elems[d * bs :].reshape(bs, d)[:t].astype(np.float32)


def stored(shape: PoolShape, x: np.ndarray) -> np.ndarray:
    """``x`` ``[n, D]`` as the store holds it (what attention reads back)."""
    if shape.precision == "f32":
        return x.astype(np.float32)
    if shape.precision == "f16":
        return x.astype(np.float16).astype(np.float32)
    return dequantize_u8(*quantize_u8(x))


@dataclass
class PagedHeads:
    """A pool and the block tables of one layer's KV heads (each head its own tokens and blocks)."""

    pool: np.ndarray  # uint8 [blocks * block_bytes]
    tables: np.ndarray  # int32 [kv_heads, max_blocks]
    lengths: np.ndarray  # int32 [kv_heads]


def page_heads(
    shape: PoolShape, keys: list[np.ndarray], values: list[np.ndarray], rng: np.random.Generator
) -> PagedHeads:
    """Lay out each KV head's ``[n_h, D]`` keys and values in blocks placed at shuffled ids (as a
    pool hands them out after evictions), with unused blocks of garbage between them."""
    per_head = [-(-k.shape[0] // shape.block_size) for k in keys]
    total = sum(per_head) + 2
    ids = rng.permutation(total)
    pool = rng.integers(0, 256, size=total * shape.block_bytes, dtype=np.uint8)
    tables = np.full((len(keys), max(max(per_head), 1)), -1, np.int32)
    at = 0
    bs = shape.block_size
    for h, (k, v) in enumerate(zip(keys, values, strict=True)):
        for b in range(per_head[h]):
            block = int(ids[at])
            at += 1
            tables[h, b] = block
            data = pack_block(shape, k[b * bs : (b + 1) * bs], v[b * bs : (b + 1) * bs])
            pool[block * shape.block_bytes : (block + 1) * shape.block_bytes] = data
    lengths = np.array([k.shape[0] for k in keys], np.int32)
    return PagedHeads(pool, tables, lengths)


@dataclass(frozen=True)
class QuantShape:
    """The 2-/4-bit store's block (``plugins/cpu/src/paged_cache.hpp``: ``qblock_bytes``): key
    codes ``[D][T / (32 / key_bits)]`` u32, key scale and zero fp16 ``[T / qgroup][D]``, value
    codes ``[T][D / (32 / value_bits)]`` u32, value scale and zero fp16 ``[T][D / qgroup]``."""

    block_size: int
    head_dim: int
    qgroup: int = 16
    key_bits: int = 2
    value_bits: int = 2
    group: int = 1

    def __post_init__(self) -> None:
        check_int("qgroup", self.qgroup, 16, self.block_size)
        check_choice("key_bits", self.key_bits, (2, 4))
        check_choice("value_bits", self.value_bits, (2, 4))
        if self.block_size % self.qgroup or self.head_dim % self.qgroup or self.qgroup % 16:
            raise ValueError(
                f"qgroup={self.qgroup} must be a multiple of 16 dividing block_size={self.block_size} "
                f"and head_dim={self.head_dim}"
            )

    @property
    def block_bytes(self) -> int:
        t, d, g = self.block_size, self.head_dim, self.qgroup
        return d * t * self.key_bits // 8 + 4 * (t // g) * d + t * d * self.value_bits // 8 + 4 * t * (d // g)

    def constants(self) -> dict[str, int]:
        return {
            "BLOCK_SIZE": self.block_size,
            "HEAD_DIM": self.head_dim,
            "QGROUP": self.qgroup,
            "KEY_BITS": self.key_bits,
            "VALUE_BITS": self.value_bits,
            "GROUP": self.group,
        }


def check_tables(
    name: str, tables: np.ndarray, lengths: np.ndarray, block_size: int, pool_bytes: int, block_bytes: int
) -> None:
    """Every block a head's ``lengths`` reach must be a block of the pool (a kernel reading past
    the pool would crash its process): a ``ValueError`` naming the field and the allowed range."""
    blocks = pool_bytes // block_bytes
    if tables.ndim != 2 or lengths.shape != (tables.shape[0],):
        raise ValueError(
            f"{name}: tables [heads, blocks] and lengths [heads] expected, got {tables.shape}, {lengths.shape}"
        )
    for h, n in enumerate(lengths.tolist()):
        used = -(-int(n) // block_size)
        if n < 0 or used > tables.shape[1]:
            raise ValueError(f"{name}: head {h} holds {n} tokens: allowed 0..{tables.shape[1] * block_size}")
        bad = [int(b) for b in tables[h, :used] if not 0 <= b < blocks]
        if bad:
            raise ValueError(f"{name}: head {h} names block {bad[0]}: allowed 0..{blocks - 1}")
