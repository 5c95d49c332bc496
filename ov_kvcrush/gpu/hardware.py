"""For people with an Intel GPU: confirm the GPU path on it, and set it beside native OpenVINO
GenAI on the same GPU.

``python -m ov_kvcrush.gpu.hardware [--budget 512] [--chars 8200] [--new-tokens 32] [--host sycl] [--out FILE]``

1. The device: the first Intel GPU OpenCL lists (with ``--allow-cpu``, Intel's OpenCL CPU runtime
   instead, and native GenAI on the CPU: a dry run of the script, which is how it is tested here).
2. For each seed method the path serves and the baselines beside them (full, SnapKV and SnapKV
   over the 2-bit store, block-wise KVCrush, ClusterKV, MiniKV): greedy tokens through the device
   cache (``TorchEngine(paged_device="opencl")``: the kernels on the GPU, the model's layers in
   torch on the host) equal to the CPU op's (the openvino engine, f32).
3. TTFT, TPOT and KV bytes of those runs beside native ``openvino_genai`` on the GPU with its
   full cache and with its KVCrush eviction, one prompt, the same budget.
4. Our decode step as OpenVINO GPU plugin layers (:mod:`~ov_kvcrush.gpu.plugin_layers`), run by
   the plugin over a pool it holds, against the reference attention (with ``--allow-cpu`` and no
   Intel GPU: the plugin on the CPU runtime under :mod:`~ov_kvcrush.gpu.emulation`).

What it cannot show: our op in a whole model inside OpenVINO's GPU plugin (not built,
docs/intel_gpu.md), so the device path's times include the model run by torch on the host and a
copy of each step's tensors; they say whether the kernels run and agree on real hardware, not how
fast a finished integration would be. Nothing here has been run on an Intel GPU by this project.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.gpu import HOSTS, emulation, plugin_layers, runtime
from ov_kvcrush.gpu.layout import PoolShape, stored

#: (row name, method, options): what the GPU path serves, as the issue's targets name it
OURS = [
    ("full", "full", {}),
    ("snapkv", "snapkv", {}),
    ("snapkv 2bit", "snapkv", {"quant": True}),
    ("kvcrush blocks", "kvcrush", {"block_size": 32}),
    ("clusterkv", "clusterkv", {}),
    ("minikv", "minikv", {}),
]
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


#: the plugin-layer check: an f16 store, two KV heads at these token counts, two decode steps
PLUGIN_SHAPE = PoolShape("f16", block_size=16, head_dim=64, group=3)
PLUGIN_TOKENS = (29, 45)
#: the largest difference from the reference the plugin-layer check passes with
PLUGIN_TOLERANCE = 1e-4


@dataclass
class PluginCheck:
    """Our decode step as the plugin's layers against the reference."""

    device: str
    max_abs_error: float

    @property
    def ok(self) -> bool:
        return self.max_abs_error < PLUGIN_TOLERANCE


def _plugin_reference_error(scenario: plugin_layers.StepScenario, results: list) -> float:
    """The largest difference of the steps' attention and probabilities from the reference
    (``methods.attention.attend``) over each KV head's tokens as the store holds them."""
    import torch

    from ov_kvcrush.methods.attention import attend

    shape, worst = scenario.attributes.shape, 0.0
    for feeds, keys, values, (out, probs) in zip(scenario.steps, scenario.keys, scenario.values, results, strict=True):
        for h in range(scenario.q_heads):
            k, v = stored(shape, keys[h // shape.group]), stored(shape, values[h // shape.group])
            ref = attend(torch.from_numpy(feeds["q"][h][None, None, None]), torch.from_numpy(k[None, None]),
                         torch.from_numpy(v[None, None]), q_positions=torch.tensor([len(k)]),
                         k_positions=torch.arange(len(k)), return_scores=True)  # fmt: skip
            worst = max(worst, float(np.abs(ref.output[0, 0, 0].numpy() - out[h]).max()),
                        float(np.abs(ref.scores[0, 0].numpy() - probs[h, : len(k)]).max()))  # fmt: skip
    return worst


def plugin_check_here() -> PluginCheck:
    """The plugin-layer check in this process, on the plugin's ``GPU``."""
    import tempfile

    from ov_kvcrush.op import plugin

    core = plugin.shared_core()
    device = emulation.plugin_device(core)
    sub_group = 16  # every Xe GPU runs 16 (Xe-HPC refuses 8)
    attributes = plugin_layers.LayerAttributes(PLUGIN_SHAPE, sub_group, PLUGIN_SHAPE.head_dim**-0.5)
    scenario = plugin_layers.random_scenario(attributes, "decode", PLUGIN_TOKENS, (1, 1), np.random.default_rng(0))
    with tempfile.TemporaryDirectory() as folder:
        results = plugin_layers.run_on_plugin(core, Path(folder), scenario)
    return PluginCheck(device, _plugin_reference_error(scenario, results))


def plugin_check(is_gpu: bool) -> PluginCheck:
    """On an Intel GPU, here; else under the emulation layer, in a fresh process."""
    if is_gpu:
        return plugin_check_here()
    reason = emulation.unavailable()
    if reason:
        raise runtime.GPUPathError(f"the plugin-layer check needs the GPU emulation: {reason}")
    with emulation.worker() as worker:
        return worker.submit(plugin_check_here).result()


def _settings(new_tokens: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)


def check(
    budget: int, chars: int, new_tokens: int, allow_cpu: bool, host: str = "opencl"
) -> tuple[list[Row], PluginCheck]:
    """The rows above, in one process (the runtime is prepared before openvino is imported); the
    device hosted by ``host`` (pyopencl, or the C++ SYCL host); then the plugin-layer check."""
    runtime.prepare()
    info = runtime.describe(runtime.find_device(allow_cpu=allow_cpu))
    from ov_kvcrush.engines.genai import GenAIEngine
    from ov_kvcrush.engines.openvino_engine import OpenVINOEngine
    from ov_kvcrush.gpu.generate import device_engine, essay_prompt
    from ov_kvcrush.models.coverage import F32
    from ov_kvcrush.models.export import ensure_default_model, hf_checkpoint

    prompt, settings = essay_prompt(chars), _settings(new_tokens)
    op = OpenVINOEngine(ensure_default_model("fp32", progress=False), kv_precision="f32", properties=F32)
    ours = device_engine(hf_checkpoint(progress=False), host)
    rows = []
    for name, method, options in OURS:
        compression = CompressionConfig(method=method, budget=budget, options=options)
        op.set_compression(compression)
        want = op.generate(prompt, settings).token_ids
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
    return rows, plugin_check(info.is_gpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ov_kvcrush.gpu.hardware", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument(
        "--chars", type=int, default=8200, help="characters of essay in the prompt (8200: ~1.8k tokens)"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--allow-cpu", action="store_true", help="a dry run on Intel's OpenCL CPU runtime")
    parser.add_argument("--host", choices=HOSTS, default="opencl", help="the device's host: pyopencl or the SYCL host")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        rows, layers = check(args.budget, args.chars, args.new_tokens, args.allow_cpu, args.host)
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
    print(f"our decode step as GPU plugin layers on {layers.device}: largest difference from the reference "
          f"{layers.max_abs_error:.3g} ({'ok' if layers.ok else 'FAILED'})")  # fmt: skip
    if args.out:
        report = {"rows": [r.__dict__ for r in rows], "plugin_layers": {**layers.__dict__, "ok": layers.ok}}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r.equal_to_cpu_op is not False for r in rows) and layers.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
