"""2- and 4-bit asymmetric group quantization and bit packing (MiniKV / KIVI storage format).

A group of ``G`` values shares one fp16 ``scale`` and ``zero`` (its minimum); a value is stored as
the code ``round((x - zero) / scale)`` in ``{0 .. 2**bits - 1}``, and ``32 / bits`` codes are
packed into one int32 (code ``i`` of a word in bits ``bits*i .. bits*i + bits - 1``). Keys are
grouped per channel along tokens (outlier channels get their own range), values per token along
channels, as in the MiniKV paper. 2 bits is MiniKV's and KIVI-2's width; 4 bits is KIVI-4's and
native OpenVINO's u4, and keys and values may use different widths (issue 24 measured a relative
error of ~0.33-0.39 on values against ~0.15-0.20 on keys at 2 bits; on needles, though, 2-bit keys
with 4-bit values answered worse than 4 bits for both: docs/quality.md).

The codes are computed from the fp16-rounded scale and zero actually stored, so dequantization
with the stored numbers is within half a quantization step of the input (plus fp16 rounding of
the stored zero).
"""

from __future__ import annotations

import torch

from ov_kvcrush.methods.attention import ShapeError

#: the packed widths implemented
BITS = (2, 4)


def codes_per_word(bits: int) -> int:
    """Codes one int32 holds: 16 at 2 bits, 8 at 4."""
    if bits not in BITS:
        raise ShapeError(f"bits={bits}: allowed one of {BITS}")
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int = 2, dim: int = -1) -> torch.Tensor:
    """Pack ``bits``-bit codes (integers in ``[0, 2**bits - 1]``) ``32 / bits`` per int32 along ``dim``."""
    per = codes_per_word(bits)
    dim = dim % codes.dim()
    m = codes.shape[dim]
    if m % per:
        raise ShapeError(f"pack_codes needs the packed dim to be a multiple of {per}, got {m}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > (1 << bits) - 1):
        raise ShapeError(f"pack_codes codes must be integers in [0, {(1 << bits) - 1}]")
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], m // per, per)
    shifts = torch.arange(0, 32, bits, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(dim=-1)  # exact: disjoint bit fields, < 2**32
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # reinterpret as signed int32
    return words.to(torch.int32).movedim(-1, dim)


def unpack_codes(packed: torch.Tensor, bits: int = 2, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 codes, ``32 / bits`` per int32 along ``dim``."""
    per = codes_per_word(bits)
    dim = dim % packed.dim()
    w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int64)
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * per).to(torch.uint8)
    return codes.movedim(-1, dim)


def quantize_groups(
    x: torch.Tensor, group: int, dim: int, bits: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` to ``bits`` bits, in groups of ``group``
    consecutive values along ``dim``.

    Returns ``(codes, scale, zero)``: ``codes`` uint8 shaped like ``x``; ``scale``/``zero`` fp16
    shaped like ``x`` with ``dim`` divided by ``group``. A constant group gets scale 0 and codes 0,
    so it dequantizes to its value up to fp16 rounding.
    """
    levels = (1 << bits) - 1
    codes_per_word(bits)  # validates bits
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
    scale = ((hi - torch.minimum(zf, lo)) / levels).to(torch.float16)
    sf = scale.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.round((xs - zf.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, levels)
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


#: the tensors of a packed key/value store, in :class:`~ov_kvcrush.methods.store.QuantStore`'s names
PACKED_KV = ("qk", "k_scale", "k_zero", "qv", "v_scale", "v_zero")


def pack_kv(
    keys: torch.Tensor, values: torch.Tensor, group: int, key_bits: int = 2, value_bits: int = 2
) -> dict[str, torch.Tensor]:
    """MiniKV's layout of ``[b, h, n, d]`` keys and values (:data:`PACKED_KV`): keys per channel
    with groups along tokens, codes packed along tokens; values per token with groups along
    channels, codes packed along channels."""
    kc, ks, kz = quantize_groups(keys, group, dim=2, bits=key_bits)
    vc, vs, vz = quantize_groups(values, group, dim=3, bits=value_bits)
    return {
        "qk": pack_codes(kc, key_bits, dim=2),
        "k_scale": ks,
        "k_zero": kz,
        "qv": pack_codes(vc, value_bits, dim=3),
        "v_scale": vs,
        "v_zero": vz,
    }


def unpack_kv(
    packed: dict[str, torch.Tensor], group: int, dtype: torch.dtype, key_bits: int = 2, value_bits: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_kv`: the dequantised keys and values in ``dtype``."""
    kc = unpack_codes(packed["qk"], key_bits, dim=2)
    vc = unpack_codes(packed["qv"], value_bits, dim=3)
    k = dequantize_groups(kc, packed["k_scale"], packed["k_zero"], group, 2, dtype)
    v = dequantize_groups(vc, packed["v_scale"], packed["v_zero"], group, 3, dtype)
    return k, v


def theoretical_bytes(num_values: int, group: int, bits: int = 2) -> int:
    """Bytes of ``num_values`` ``bits``-bit values with one fp16 scale and zero per group (MiniKV's formula)."""
    return num_values * bits // 8 + (num_values // group) * 2 * 2
