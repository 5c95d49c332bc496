"""What a bench run measures besides the engines' own timings: the memory bandwidth (the
floor a decode step cannot beat), percentiles, a process's peak RSS, the weights a step reads, and
the machine and versions of the run."""

from __future__ import annotations

import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ov_kvcrush.errors import ConfigError

# Imported where used, inside functions: what pulls in numpy, platformdirs, torch, transformers,
# heavy to import, so that importing this module stays light.


def measure_bandwidth_gbps(mib: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """The memory bandwidth of ``device``: the best of ``repeats`` copies of a ``mib`` MiB array,
    counting the bytes read and the bytes written (GB/s, 1e9 bytes). ``cuda[:N]`` measures that
    GPU's memory (the floor of the torch engine running there)."""
    if device.lower().startswith("cuda"):
        import torch

        src = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats + 1):  # the first copy warms the allocator and the driver up
            torch.cuda.synchronize(src.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(src.device)
            best = min(best, time.perf_counter() - t0)
        return 2 * src.numel() * 4 / best / 1e9
    import numpy as np

    src = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def floor_ms(weight_bytes: int, kv_bytes: int, bandwidth_gbps: float) -> float:
    """The least time a decode step can take: read every weight and every KV byte once."""
    if bandwidth_gbps <= 0:
        raise ConfigError("bandwidth_gbps", bandwidth_gbps, "a positive number")
    return (weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9) * 1e3


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RssSampler:
    """Peak resident memory of this process while a run lasts (sampled every ``period`` s)."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: the process's peak so far
            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def weight_bytes(engine: Any) -> int:
    """Bytes of weights a decode step reads: the torch model's parameters, else the IR's (or
    GGUF's) weight file(s) as stored (int8 weights count one byte each)."""
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "parameters"):
        return int(sum(p.numel() * p.element_size() for p in model.parameters()))
    d = Path(getattr(engine, "model_dir", ""))
    if d.is_file():
        return d.stat().st_size
    return int(sum(f.stat().st_size for f in d.glob("openvino_model*.bin")))


def describe_run() -> dict[str, Any]:
    """The command, the machine and the package versions of this run."""
    from ov_kvcrush.eval.runner import package_versions

    return {
        "command": " ".join(["ov-kvcrush", *sys.argv[1:]]) if sys.argv else "",
        "machine": {
            "cpu": cpu_name(),
            "arch": platform.machine(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "python": sys.version.split()[0],
            "system": platform.platform(),
        },
        "versions": package_versions(),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
