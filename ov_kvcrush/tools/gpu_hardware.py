"""For people with an Intel GPU: confirm the GPU path on it, and set it beside native OpenVINO
GenAI on the same GPU.

``python -m ov_kvcrush.tools.gpu_hardware [--budget 512] [--chars 8200] [--new-tokens 32] [--host sycl] [--plugin]
[--out FILE]``

1. The device: the first Intel GPU OpenCL lists (with ``--allow-cpu``, Intel's OpenCL CPU runtime
   instead, and native GenAI on the CPU: a dry run of the script, which is how it is tested here).
2. For each seed method the path serves and the baselines beside them (full, SnapKV and SnapKV
   over the 2-bit store, block-wise KVCrush, ClusterKV, MiniKV): greedy tokens through the device
   cache (``TorchEngine(paged_device="opencl")``: the kernels on the GPU, the model's layers in
   torch on the host) equal to the CPU op's (the openvino engine, f32).
3. TTFT, TPOT and KV bytes of those runs beside native ``openvino_genai`` on the GPU with its
   full cache and with its KVCrush eviction, one prompt, the same budget.
4. The product path on the GPU: the embedded model through the openvino engine on ``GPU`` (our
   layers in OpenVINO's GPU plugin, the methods' kernels over the same pool between steps:
   :mod:`~ov_kvcrush.engines.gpu_plugin_model`) for every row of step 2, KVzip and Chelsea
   ("plugin ..." rows: the 2-bit store and ClusterKV's recall inside the model among them, KVzip's
   scoring pass through the model, Chelsea's decode merge in it), their greedy tokens against the
   CPU op's, with TTFT, TPOT and KV bytes (in a dry run only with ``--plugin``: the plugin then
   runs on the CPU runtime under :mod:`~ov_kvcrush.gpu.emulation`).

The rows of step 2 run the model's layers in torch on the host and copy each step's tensors:
they say whether every method's kernels run and agree on real hardware. The "plugin" rows are
what ``device="GPU"`` runs; their times on a GPU are what a user would see of one sequence
at f32 inference precision (the plugin's default is f16; docs/intel_gpu.md). Nothing here has been run on an
Intel GPU by this project.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.gpu import HOSTS, emulation, runtime

# Imported where used, inside functions: what pulls in platformdirs, torch, heavy to import, so that
# importing this module stays light.

#: (row name, method, options): what the GPU path serves, as the issue's targets name it
OURS = [
    ("full", "full", {}),
    ("snapkv", "snapkv", {}),
    ("snapkv 2bit", "snapkv", {"quant": True}),
    ("kvcrush blocks", "kvcrush", {"block_size": 32}),
    ("clusterkv", "clusterkv", {}),
    ("minikv", "minikv", {}),
]
#: the rows of the openvino engine on ``GPU`` (named as in :data:`OURS`; the CPU op's runs are their
#: oracle): every one, since the plugin's layers run them all (the 2-bit store, ClusterKV's recall),
#: and KVzip and Chelsea, whose scoring pass and decode merge are the plugin's model's (the torch
#: path's pool runs neither)
PLUGIN_ROWS = [*OURS, ("kvzip", "kvzip", {}), ("chelsea", "chelsea", {})]
#: native GenAI's rows: its full cache and its KVCrush eviction (its own block-wise form)
NATIVE = [("native full", "full"), ("native kvcrush", "kvcrush")]


@dataclass
class Row:
    name: str
    device: str
    prompt_tokens: int
    ttft_ms: float
    tpot_ms: float
    kv_bytes: int
    equal_to_cpu_op: bool | None  # None: not compared (native rows)


def plugin_rows(ids: list[int], want: dict[str, list[int]], new_tokens: int, budget: int, is_gpu: bool) -> list[Row]:
    """The embedded model through the openvino engine on ``GPU`` (our layers in OpenVINO's GPU
    plugin, the methods over its pool: :mod:`~ov_kvcrush.engines.gpu_plugin_model`, f32 KV) for the rows of
    :data:`PLUGIN_ROWS`, their greedy tokens against the CPU op's ``want`` (by row name): on an
    Intel GPU in this process, else under the emulation layer in a fresh process."""
    from ov_kvcrush.models.export import ensure_default_model
    from ov_kvcrush.tools.gpu_plugin_check import run_greedy

    model_dir = ensure_default_model("fp32", progress=False)
    compressions = [CompressionConfig(method=m, budget=None if m == "full" else budget, options=o)
                    for _, m, o in PLUGIN_ROWS]  # fmt: skip
    if is_gpu:
        runs = run_greedy(model_dir, ids, new_tokens, compressions)
    else:
        reason = emulation.unavailable()
        if reason:
            raise runtime.GPUPathError(f"the plugin rows need the GPU emulation: {reason}")
        with emulation.worker() as worker:
            runs = worker.submit(run_greedy, model_dir, ids, new_tokens, compressions).result()
    return [Row(f"plugin {name}", r.device, len(ids), r.prompt_ms, r.decode_ms, r.kv_bytes, r.tokens == want[name])
            for (name, _, _), r in zip(PLUGIN_ROWS, runs, strict=True)]  # fmt: skip


def _settings(new_tokens: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)


def check(
    budget: int, chars: int, new_tokens: int, allow_cpu: bool, host: str = "opencl", plugin: bool = False
) -> list[Row]:
    """The rows above, in one process (the runtime is prepared before openvino is imported); the
    device hosted by ``host`` (pyopencl, or the C++ SYCL host); the plugin row on an Intel GPU, or
    with ``plugin``."""
    runtime.prepare()
    info = runtime.describe(runtime.find_device(allow_cpu=allow_cpu))
    from ov_kvcrush.engines.genai import GenAIEngine
    from ov_kvcrush.models.export import ensure_default_model, hf_checkpoint
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.gpu_generate import device_engine, essay_prompt
    from ov_kvcrush.tools.model_coverage import F32

    prompt, settings = essay_prompt(chars), _settings(new_tokens)
    op = OpenVINOEngine(ensure_default_model("fp32", progress=False), kv_precision="f32", properties=F32)
    ours = device_engine(hf_checkpoint(progress=False), host)
    rows, cpu_tokens = [], {}
    for name, method, options in OURS:
        compression = CompressionConfig(method=method, budget=budget, options=options)
        op.set_compression(compression)
        want = op.generate(prompt, settings).token_ids
        cpu_tokens[name] = list(want)  # the plugin rows' oracle too
        ours.set_compression(compression)
        got = ours.generate(prompt, settings)
        rows.append(Row(name, info.name, got.prompt_tokens, got.ttft_ms, got.tpot_ms, got.kv_bytes,
                        got.token_ids == want))  # fmt: skip
    native_device = "GPU" if info.is_gpu else "CPU"
    for name, method in NATIVE:
        native = GenAIEngine(ensure_default_model(progress=False), CompressionConfig(method=method, budget=budget),
                             device=native_device)  # fmt: skip
        res = native.generate(prompt, settings)
        rows.append(Row(name, native_device, res.prompt_tokens, res.ttft_ms, res.tpot_ms, res.kv_bytes, None))
    if info.is_gpu or plugin:
        for name, method, options in PLUGIN_ROWS:
            if name not in cpu_tokens:  # the plugin's alone: the CPU op's tokens are its oracle
                op.set_compression(CompressionConfig(method=method, budget=budget, options=options))
                cpu_tokens[name] = list(op.generate(prompt, settings).token_ids)
        rows += plugin_rows(op.encode(prompt), cpu_tokens, new_tokens, budget, info.is_gpu)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ov_kvcrush.tools.gpu_hardware", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument(
        "--chars", type=int, default=8200, help="characters of essay in the prompt (8200: ~1.8k tokens)"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--allow-cpu", action="store_true", help="a dry run on Intel's OpenCL CPU runtime")
    parser.add_argument("--host", choices=HOSTS, default="opencl", help="the device's host: pyopencl or the SYCL host")
    parser.add_argument("--plugin", action="store_true", help="in a dry run, the plugin row too (under the emulation)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        rows = check(args.budget, args.chars, args.new_tokens, args.allow_cpu, args.host, args.plugin)
    except runtime.GPUPathError as e:
        print(f"hardware check: {e}")
        return 2
    print(
        f"{'row':16s} {'device':40s} {'prompt':>6s} {'TTFT ms':>9s} {'TPOT ms':>8s} {'KV bytes':>11s}  tokens = CPU op"
    )
    for r in rows:
        same = "-" if r.equal_to_cpu_op is None else str(r.equal_to_cpu_op)
        print(f"{r.name:16s} {r.device[:40]:40s} {r.prompt_tokens:6d} {r.ttft_ms:9.1f} {r.tpot_ms:8.2f} "
              f"{r.kv_bytes:11d}  {same}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    return 0 if all(r.equal_to_cpu_op is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
