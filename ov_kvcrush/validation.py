"""Range checks shared by every configuration: the leaf of the package's import graph.

Each check raises :class:`~ov_kvcrush.errors.ConfigError` naming the field and its allowed range,
so a bad CLI flag or library call fails with one line before any model is loaded. This module
imports nothing of the package but :mod:`ov_kvcrush.errors`; configs, methods, engines and the
evaluation all validate through it, so validation never pulls in what it validates.
"""

from __future__ import annotations

from typing import Any

from ov_kvcrush.errors import ConfigError

#: Largest value accepted for token counts, far above any context these models handle; it keeps
#: typos (an extra zero) from turning into multi-GB allocations.
MAX_TOKENS = 1 << 20


def check_int(name: str, value: Any, lo: int, hi: int = MAX_TOKENS) -> None:
    """``value`` must be an ``int`` (not a ``bool``) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(name, value, f"an integer in [{lo}, {hi}]")


def check_float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    """``value`` must be a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    allowed = f"a number in {'(' if lo_open else '['}{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, value, allowed)
    if not ((value > lo if lo_open else value >= lo) and value <= hi):
        raise ConfigError(name, value, allowed)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ConfigError(name, value, "one of " + ", ".join(choices))


def check_budget(name: str, budget: Any, floor: int, what: str = "") -> None:
    """``budget`` must be an int in ``[floor, MAX_TOKENS]``; ``what`` explains the floor."""
    if isinstance(budget, bool) or not isinstance(budget, int) or not floor <= budget <= MAX_TOKENS:
        raise ConfigError(name, budget, f"an integer in [{floor}, {MAX_TOKENS}]{what}")
