"""How the CPU op's bf16 prompt kernel multiplies on this machine, chosen once per CPU and kept.

Two ways give the same products (``plugins/cpu/src/kernels.hpp``, ``Bf16Products``): AVX512-BF16
dot products, or the operands widened to f32 FMAs; which is faster depends on the core (an AMD Zen
4 runs the dot products at the FMAs' rate, some Intel Xeons at a quarter of it). The library used
to time a fraction of a millisecond of each inside the first prompt, and on a busy machine (a
server's first prompt, exactly when it is busy) that probe flipped: the wrong path cost 30 % of
the prompt step (issue 72). So the choice is made from the best of many alternating trials, once
per CPU, and kept in the user cache (``<cache>/cpu/bf16_products.json``, one entry per CPU
identity: a home shared by several machines keeps each one's), then set in the library when it is
loaded. ``OVKC_BF16_PRODUCTS=dot|widened`` still decides where it is set. ``ov-kvcrush envcheck``
prints the choice and why.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from ov_kvcrush.paths import cache_root

#: the library's names of the two ways, by its index
BF16_PRODUCTS = ("dot", "widened")
#: what selects a way by name, before any measurement
ENV = "OVKC_BF16_PRODUCTS"
#: the cache file's layout; another version is measured again and rewritten
FORMAT = 1


@dataclass(frozen=True)
class Bf16Choice:
    """The way chosen and why.

    Attributes:
        products: ``dot`` or ``widened``.
        why: how it was chosen, in words (``envcheck`` prints it).
        dot_rate, fma_rate: the measured multiply-adds per second of each way (0: not measured
            here, or no AVX512-BF16).
    """

    products: str
    why: str
    dot_rate: float = 0.0
    fma_rate: float = 0.0


def cache_file() -> Path:
    return cache_root() / "cpu" / "bf16_products.json"


def cpu_identity() -> str:
    """This CPU as its vendor, family, model, stepping and name (``/proc/cpuinfo``'s first core),
    beside the machine's architecture: what a choice kept for it must match."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first core's block
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    parts = [fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "stepping", "model name")]
    return " / ".join([platform.machine(), *parts])


def measure(lib: ctypes.CDLL, rounds: int = 0) -> Bf16Choice | None:
    """The library's measurement on this core now, from ``rounds`` trials of each way (0: the
    library's own count, what it chooses by itself from); None: no AVX512-BF16, nothing to choose."""
    dot, fma = ctypes.c_double(), ctypes.c_double()
    index = lib.ovkc_measure_bf16_products(rounds, ctypes.byref(dot), ctypes.byref(fma))
    if index < 0:
        return None
    why = f"measured on this CPU: dot products {dot.value / 1e9:.0f}, f32 FMAs {fma.value / 1e9:.0f} GMAC/s"
    return Bf16Choice(BF16_PRODUCTS[index], why, dot.value, fma.value)


def choose(lib: ctypes.CDLL) -> Bf16Choice:
    """The way for this process: the environment's, else the one kept for this CPU, else one
    measured now and kept. Sets it in the library (except the environment's, which the library
    reads itself)."""
    env = os.environ.get(ENV)
    if env in BF16_PRODUCTS:
        return Bf16Choice(env, f"set by {ENV}")
    cpu = cpu_identity()
    kept = _read_kept(cpu)
    if kept is None:
        measured = measure(lib)
        if measured is None:
            return Bf16Choice("dot", "no AVX512-BF16 here: the bf16 prompt path is not used")
        _keep(cpu, measured)
        choice = measured
    else:
        choice = kept
    lib.ovkc_set_bf16_products(BF16_PRODUCTS.index(choice.products))
    return choice


def _read_kept(cpu: str) -> Bf16Choice | None:
    """The choice kept for ``cpu``; None where there is none, or the file is unreadable, of
    another format or malformed (then measured again and rewritten)."""
    try:
        data = json.loads(cache_file().read_text())
        entry = data["cpus"][cpu] if data.get("format") == FORMAT else None
        if entry is None or entry["products"] not in BF16_PRODUCTS:
            return None
        dot, fma = float(entry["dot_rate"]), float(entry["fma_rate"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    why = f"kept for this CPU in {cache_file()} (dot products {dot / 1e9:.0f}, f32 FMAs {fma / 1e9:.0f} GMAC/s)"
    return Bf16Choice(entry["products"], why, dot, fma)


def _keep(cpu: str, choice: Bf16Choice) -> None:
    """Add ``cpu``'s choice to the file, written whole beside it and renamed into place (a reader
    never sees half a file); a cache that cannot be written leaves the choice to this process."""
    path = cache_file()
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("cpus"), dict):
            data = {}
    except (OSError, ValueError, AttributeError):
        data = {}
    entry = {"products": choice.products, "dot_rate": choice.dot_rate, "fma_rate": choice.fma_rate}
    data = {"format": FORMAT, "cpus": {**data.get("cpus", {}), cpu: entry}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
