"""What every benchmark result carries: the command that made it, the machine and the versions.

Shared by the scripts in this folder (run as ``python benchmarks/<script>.py``, which puts this
folder on ``sys.path``), so every committed JSON describes its run the same way.
"""

from __future__ import annotations

import os
import platform
import sys


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
