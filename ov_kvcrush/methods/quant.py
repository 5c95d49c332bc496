"""2-bit asymmetric group quantization and bit packing (MiniKV / KIVI storage format).

A group of ``G`` values shares one fp16 ``scale`` and ``zero`` (its minimum); a value is stored as
the code ``round((x - zero) / scale)`` in ``{0, 1, 2, 3}``, and 16 codes are packed into one int32
(code ``i`` of a word in bits ``2i, 2i+1``). Keys are grouped per channel along tokens (outlier
channels get their own range), values per token along channels, as in the MiniKV paper.

The codes are computed from the fp16-rounded scale and zero actually stored, so dequantization
with the stored numbers is within half a quantization step of the input (plus fp16 rounding of
the stored zero).
"""

from __future__ import annotations

import torch

from ov_kvcrush.methods.attention import ShapeError

BITS = 2
LEVELS = (1 << BITS) - 1  # codes 0..3
PER_WORD = 32 // BITS  # 16 codes per int32


def pack_2bit(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack 2-bit codes (integers in [0, 3]) 16 per int32 along ``dim`` (its size a multiple of 16)."""
    dim = dim % codes.dim()
    m = codes.shape[dim]
    if m % PER_WORD:
        raise ShapeError(f"pack_2bit needs the packed dim to be a multiple of {PER_WORD}, got {m}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > LEVELS):
        raise ShapeError("pack_2bit codes must be integers in [0, 3]")
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], m // PER_WORD, PER_WORD)
    shifts = torch.arange(0, 32, BITS, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(dim=-1)  # exact: disjoint bit fields, < 2**32
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # reinterpret as signed int32
    return words.to(torch.int32).movedim(-1, dim)


def unpack_2bit(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: uint8 codes, 16 per int32 along ``dim``."""
    dim = dim % packed.dim()
    w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, BITS, device=packed.device, dtype=torch.int64)
    codes = (w.unsqueeze(-1) >> shifts) & LEVELS
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * PER_WORD).to(torch.uint8)
    return codes.movedim(-1, dim)


def quantize_groups(x: torch.Tensor, group: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` in groups of ``group`` consecutive values along ``dim``.

    Returns ``(codes, scale, zero)``: ``codes`` uint8 shaped like ``x``; ``scale``/``zero`` fp16
    shaped like ``x`` with ``dim`` divided by ``group``. A constant group gets scale 0 and codes 0,
    so it dequantizes to its value up to fp16 rounding.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group:
        raise ShapeError(f"quantized dim has {n} values, not a multiple of group_size={group}")
    xs = x.movedim(dim, -1).float()
    xs = xs.reshape(*xs.shape[:-1], n // group, group)
    lo = xs.amin(dim=-1)
    hi = xs.amax(dim=-1)
    zero = lo.to(torch.float16)
    zf = zero.float()
    # the stored zero may round above the true minimum; widen the range so every value is covered
    scale = ((hi - torch.minimum(zf, lo)) / LEVELS).to(torch.float16)
    sf = scale.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.round((xs - zf.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, LEVELS)
    codes = torch.where(sf.unsqueeze(-1) > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    codes = codes.reshape(*codes.shape[:-2], n).movedim(-1, dim)
    return codes, scale.movedim(-1, dim), zero.movedim(-1, dim)


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: ``zero + code * scale`` per group, in ``dtype``."""
    dim = dim % codes.dim()
    s = scale.float().repeat_interleave(group, dim=dim)
    z = zero.float().repeat_interleave(group, dim=dim)
    return (z + codes.float() * s).to(dtype)


#: the tensors of a packed 2-bit key/value store, in :class:`~ov_kvcrush.methods.store.Int2Store`'s names
PACKED_KV = ("qk", "k_scale", "k_zero", "qv", "v_scale", "v_zero")


def pack_kv(keys: torch.Tensor, values: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """MiniKV's 2-bit layout of ``[b, h, n, d]`` keys and values (:data:`PACKED_KV`): keys per
    channel with groups along tokens, values per token with groups along channels, 16 codes per int32."""
    kc, ks, kz = quantize_groups(keys, group, dim=2)
    vc, vs, vz = quantize_groups(values, group, dim=3)
    return {
        "qk": pack_2bit(kc, dim=2),
        "k_scale": ks,
        "k_zero": kz,
        "qv": pack_2bit(vc, dim=3),
        "v_scale": vs,
        "v_zero": vz,
    }


def unpack_kv(packed: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_kv`: the dequantised keys and values in ``dtype``."""
    k = dequantize_groups(unpack_2bit(packed["qk"], dim=2), packed["k_scale"], packed["k_zero"], group, 2, dtype)
    v = dequantize_groups(unpack_2bit(packed["qv"], dim=3), packed["v_scale"], packed["v_zero"], group, 3, dtype)
    return k, v


def theoretical_bytes(num_values: int, group: int) -> int:
    """Bytes of ``num_values`` 2-bit values with one fp16 scale and zero per group (MiniKV's formula)."""
    return num_values * BITS // 8 + (num_values // group) * 2 * 2
