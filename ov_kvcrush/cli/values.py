"""Values of the ``ov-kvcrush`` flags: comma-separated lists, sizes, numbers, names. A bad value is
a :class:`~ov_kvcrush.errors.UserError` naming the flag (one line, no traceback); each converter's
docstring is what the message says the flag takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ov_kvcrush.errors import UserError

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


def split_values(flag: str, text: str, convert: Callable[[str], Any]) -> tuple:
    """The comma-separated items of ``text`` through ``convert`` (one line naming ``flag`` on a bad one)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(convert(item))
        except ValueError:
            raise UserError(f"{flag}: {item!r} is not valid ({convert.__doc__})") from None
    if not out:
        raise UserError(f"{flag}: empty list")
    return tuple(out)


def parse_size(text: str) -> int:
    """a byte count, optionally with KiB/MiB/GiB/KB/MB/GB"""
    low = text.lower()
    num = low.rstrip("kmgib")
    unit = low[len(num) :]
    if unit not in _SIZE_UNITS:
        raise ValueError(text)
    return round(float(num) * _SIZE_UNITS[unit])


def parse_int(text: str) -> int:
    """an integer"""
    return int(text)


def parse_float(text: str) -> float:
    """a number"""
    return float(text)


def parse_name(text: str) -> str:
    """a name"""
    return text
