"""What every benchmark result carries: the command that made it, the machine and the versions.

Shared by the scripts in this folder (run as ``python benchmarks/<script>.py``, which puts this
folder on ``sys.path``), so every committed JSON describes its run the same way.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_info(argv: list[str] | None) -> dict:
    """``command``, ``machine``, ``versions`` and ``kernels`` of the current run."""
    import openvino
    import openvino_genai

    from ov_kvcrush.plugin import kernel_isa

    return {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)),
            "python": sys.version.split()[0],
        },
        "versions": {"openvino": openvino.__version__, "openvino_genai": openvino_genai.__version__},
        "kernels": kernel_isa(),
    }


def write_results(
    argv: list[str] | None,
    t_start: float,
    results: list[dict],
    runs: list[dict],
    json_out: str | None,
    plot_out: str | None,
    plot: Callable[[list[dict], str], None],
    **extra: Any,
) -> dict:
    """The run's JSON document (run_info, ``extra``, wall time, results, every run); written to
    ``json_out`` and plotted to ``plot_out`` when given."""
    doc = {**run_info(argv), **extra, "wall_s": round(time.time() - t_start, 1), "results": results, "runs": runs}
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=2))
    if plot_out:
        plot(results, plot_out)
    return doc
