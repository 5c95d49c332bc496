"""Errors the user can act on.

Anything raised as :class:`UserError` is printed by the CLI as one line and exits with code 2, no
traceback: bad configuration, a missing path, a model that cannot be used, a request the native
pipeline is known to crash on. Internal bugs stay ordinary exceptions so they keep their traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input, explained in one line.

    Subclasses ``ValueError`` so library users catching the usual exception for bad arguments
    keep working.
    """


class ConfigError(UserError):
    """A configuration field is out of its allowed range; the message names the field."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: allowed {allowed}")

    def __reduce__(self) -> tuple:
        # pickled by its fields, so it crosses a process boundary (the GPU path's worker, the
        # bench's): the default pickles the message alone, and unpickling it then fails
        return type(self), (self.field, self.value, self.allowed)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line: its last non-empty line (native errors carry a trace of
    source locations above the message), or its type when it has no message."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def decode_text(data: bytes, what: str) -> str:
    """``data`` as UTF-8 text; otherwise a :class:`UserError` naming ``what`` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): allowed UTF-8 text"
        ) from None
