"""Offline compiles of the op's OpenCL kernels for Intel GPUs with ``ocloc`` (no GPU needed).

Intel's OpenCL CPU runtime accepts code that a GPU compiler refuses (a required sub-group size
the target lacks, block reads in SIMD32), so every kernel source is also compiled for Xe-LP
(``tgllp``), Arc / Xe-HPG (``dg2-g10``) and Xe-HPC (``pvc``), at each sub-group size the target
runs and each set of compile-time constants the host builds it with, and once with the option a
device whose buffers may pass its largest allocation builds them with (``LARGE_BUFFER_OPTION``).
``ocloc`` ships in Debian's ``intel-opencl-icd``.

``python -m ov_kvcrush.gpu.offline`` compiles them all and prints one line per build.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ov_kvcrush.gpu.clusterkv import CLUSTER_LANES
from ov_kvcrush.gpu.device import build_options, kernel_dir
from ov_kvcrush.gpu.plugin_layers import KERNELS

# sub-group sizes each target compiles (Xe-HPC refuses a required size of 8)
TARGETS: dict[str, tuple[int, ...]] = {"tgllp": (8, 16), "dg2-g10": (8, 16), "pvc": (16,)}

# where a source's other sets of constants are compiled
ALSO_ON = ("dg2-g10", 16)

# the compile-time constants each source is built with by its host (a few representative shapes:
# SmolLM2's and Llama-3-8B's head sizes and groups, every store precision)
#: every layer of plugin_layers.cl at once (the plugin builds each alone: ov_kvcrush.gpu.plugin_layers)
PLUGIN_LAYER_GUARDS = {kernel.guard: 1 for kernel in KERNELS.values()}
VARIANTS: dict[str, list[dict[str, int]]] = {
    "paged_attention.cl": [{"KV_PRECISION": p, "BLOCK_SIZE": 32, "HEAD_DIM": 64, "GROUP": 3} for p in (0, 1, 2)]
    + [{"KV_PRECISION": 2, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "GROUP": 4}],
    "kvcrush.cl": [{}],
    "snapkv.cl": [{}],
    "paged_store.cl": [{"KV_PRECISION": p, "BLOCK_SIZE": 32, "HEAD_DIM": 64} for p in (0, 1, 2)],
    "prefill.cl": [{"KV_PRECISION": p, "BLOCK_SIZE": 32, "HEAD_DIM": 64, "GROUP": 3} for p in (1, 2)]
    + [{"KV_PRECISION": 2, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "GROUP": 4}],
    "clusterkv.cl": [{"HEAD_DIM": 64, "GROUP": 3}, {"HEAD_DIM": 128, "GROUP": 4}],
    "kmeans.cl": [{"KV_PRECISION": p, "BLOCK_SIZE": 32, "HEAD_DIM": 64, "LANES": CLUSTER_LANES} for p in (0, 1, 2)]
    + [{"KV_PRECISION": 1, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "LANES": CLUSTER_LANES}],
    # the bodies are the kernels' above (built at each store precision there): one store here, in
    # f32 and in f16 activations (ACT_HALF: the plugin's default inference precision)
    # (the 2-bit store's layers: MiniKV's 2-bit chunks of 32 tokens, then 4-bit chunks of 64)
    "plugin_layers.cl": [
        {"KV_PRECISION": 2, "BLOCK_SIZE": 32, "HEAD_DIM": 64, "GROUP": 3, "SCALE": 1, **PLUGIN_LAYER_GUARDS}
        | {"QUANT_TOKENS": 32, "QGROUP": 16, "KEY_BITS": 2, "VALUE_BITS": 2},
        {"KV_PRECISION": 1, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "GROUP": 4, "SCALE": 1, "ACT_HALF": 1}
        | PLUGIN_LAYER_GUARDS
        | {"QUANT_TOKENS": 64, "QGROUP": 32, "KEY_BITS": 4, "VALUE_BITS": 4},
    ],
    "quest.cl": [{"KV_PRECISION": p, "BLOCK_SIZE": 32, "HEAD_DIM": 64} for p in (0, 1, 2)],
    "chelsea.cl": [{"KV_PRECISION": p, "BLOCK_SIZE": 32, "HEAD_DIM": 64} for p in (0, 1, 2)]
    + [{"KV_PRECISION": 1, "BLOCK_SIZE": 16, "HEAD_DIM": 128}],
    "quant2.cl": [
        {"BLOCK_SIZE": 32, "HEAD_DIM": 64, "QGROUP": 16, "KEY_BITS": kb, "VALUE_BITS": vb, "GROUP": 3}
        for kb, vb in ((2, 2), (4, 4))
    ]
    + [{"BLOCK_SIZE": 64, "HEAD_DIM": 128, "QGROUP": 32, "KEY_BITS": 2, "VALUE_BITS": 2, "GROUP": 4}],
}


@dataclass(frozen=True)
class Build:
    source: str
    target: str
    sub_group: int
    constants: tuple[tuple[str, int], ...]
    large_buffers: bool
    ok: bool
    log: str


def ocloc() -> str | None:
    return shutil.which("ocloc")


def builds() -> list[tuple[str, str, int, dict[str, int], bool]]:
    """Every (source, target, sub-group size, constants, large buffers) to compile: each source's
    first set of constants on every target at every sub-group size it runs (what a target refuses
    depends on the target and the sub-group size), its other sets on :data:`ALSO_ON` (what the
    constants change is the code's shape, not the target's rules), and its first set there with
    the large buffers' option (64-bit offsets: a pool past one allocation)."""
    out = []
    for path in sorted(kernel_dir().glob("*.cl")):
        first, *others = VARIANTS.get(path.name, [{}])
        for target, sizes in TARGETS.items():
            out += [(path.name, target, sg, first, False) for sg in sizes]
        out += [(path.name, *ALSO_ON, constants, False) for constants in others]
        out.append((path.name, *ALSO_ON, first, True))
    return out


def compile_one(
    source: str, target: str, sub_group: int, constants: dict[str, int], large_buffers: bool = False
) -> Build:
    """One ``ocloc compile``; ``ok`` is a zero exit with no error in its output."""
    tool = ocloc()
    if tool is None:
        raise FileNotFoundError("ocloc is not installed (Debian: apt-get install intel-opencl-icd)")
    options = " ".join(build_options(sub_group, constants, large_buffers))
    with tempfile.TemporaryDirectory() as out:
        cmd = [tool, "compile", "-file", str(kernel_dir() / source), "-device", target, "-options", options]
        res = subprocess.run([*cmd, "-out_dir", out, "-q"], capture_output=True, text=True, timeout=300)
    log = (res.stdout + res.stderr).strip()
    ok = res.returncode == 0 and "error" not in log.lower()
    return Build(source, target, sub_group, tuple(sorted(constants.items())), large_buffers, ok, log)


def main(argv: list[str] | None = None) -> int:
    del argv
    failed = 0
    for source, target, sg, constants, large in builds():
        b = compile_one(source, target, sg, constants, large)
        failed += not b.ok
        large_text = " (large buffers)" if large else ""
        print(f"{'ok  ' if b.ok else 'FAIL'} {source} {target} SG={sg} {dict(b.constants)}{large_text}")
        if not b.ok:
            print("   ", b.log.replace("\n", "\n    "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
