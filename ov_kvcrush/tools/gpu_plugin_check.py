"""The openvino backend on ``GPU`` beside the CPU op: an embedded model's greedy tokens through
both for each method, with the times, the KV bytes and the bytes that cross between host and
device per decode step.

``python -m ov_kvcrush.tools.gpu_plugin_check [--methods full,snapkv,kvcrush:block_size=32] [--budget 512]
[--chars 1500] [--new-tokens 8] [--kv-precision f32] [--inference-precision f32] [--allow-cpu]
[--model gemma3-270m] [--out FILE]``; ``--allow-cpu``: without an Intel GPU, the plugin on Intel's OpenCL CPU runtime
under the emulation layer (its times say nothing of a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ov_kvcrush.config import CompressionConfig, GenerationSettings, MethodSpec
from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu import emulation, runtime
from ov_kvcrush.methods import require
from ov_kvcrush.methods.runtimes import CPU_OP, GPU_PLUGIN
from ov_kvcrush.outputs import write_atomic
from ov_kvcrush.tools.gpu_generate import essay_prompt

# Imported where used, inside functions: what pulls in platformdirs, heavy to import, so that
# importing this module stays light.


@dataclass
class PluginRun:
    """A greedy run through the openvino engine on ``GPU``."""

    device: str
    tokens: list[int]
    compile_s: float
    prompt_ms: float
    decode_ms: float
    kv_bytes: int
    #: per decode step: bytes that crossed between host and device, by what they were, and the KV
    #: bytes the model's attention read in place
    crossed_per_step: dict[str, float]
    kv_read_per_step: float


def run_greedy(
    model_dir: str | Path, ids: list[int], new_tokens: int, compressions: list[CompressionConfig],
    kv_precision: str = "f32", inference_precision: str = "f32",
) -> list[PluginRun]:  # fmt: skip
    """``new_tokens`` greedy tokens after ``ids`` through the openvino engine on ``GPU`` (compiled
    once, at ``inference_precision``: f32, where the CPU op's tokens are the oracle, or f16, the
    GPU's default), for each of ``compressions``, in this process."""
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    properties = {"INFERENCE_PRECISION_HINT": inference_precision}
    engine = OpenVINOEngine(model_dir, compressions[0], device="GPU", kv_precision=kv_precision, properties=properties)
    assert engine.plugin is not None
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    runs = []
    try:
        for compression in compressions:
            engine.set_compression(compression)
            res = engine.batcher.run(ids, settings, None)
            pool = engine.pool
            steps = max(pool.decode_steps, 1)
            c = pool.device_pool.crossings["decode"]
            crossed = {f"{k} (to device)": v / steps for k, v in c.to_device.items()}
            crossed |= {f"{k} (to host)": v / steps for k, v in c.to_host.items()}
            read = pool.decode_kv_read / steps
            runs.append(PluginRun(engine.plugin.device, list(res.token_ids), engine.plugin.compile_seconds,
                                  res.ttft_ms, res.tpot_ms, res.kv_bytes, crossed, read))  # fmt: skip
    finally:
        engine.close()
    return runs


def read_compressions(methods: list[str], budget: int) -> list[CompressionConfig]:
    """Each of ``methods`` (``NAME`` or ``NAME:KEY=VALUE[:...]``) at ``budget`` (the full cache at
    none), checked before any run: the plugin runs it, and the CPU op, the check's oracle, too."""
    compressions = []
    for method in methods:
        spec = MethodSpec.read(method)
        name = spec.method
        compression = CompressionConfig(method=name, budget=None if name == "full" else budget,
                                        options=spec.method_options())  # fmt: skip
        require(compression.method_config(), GPU_PLUGIN.name)
        try:
            require(compression.method_config(), CPU_OP.name)
        except UserError as e:
            raise UserError(f"the CPU op's tokens are the check's oracle, and {e}") from e
        compressions.append(compression)
    return compressions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ov_kvcrush.tools.gpu_plugin_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--methods", default="full", help="comma-separated, each NAME or NAME:KEY=VALUE[:...]")
    parser.add_argument("--budget", type=int, default=512, help="the methods' budget (not the full cache's)")
    parser.add_argument("--chars", type=int, default=1500, help="characters of essay in the prompt")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--kv-precision", choices=("f32", "f16", "u8"), default="f32")
    parser.add_argument(
        "--inference-precision", choices=("f32", "f16"), default="f32",
        help="the plugin's (f16: the GPU's default; the CPU op's tokens, in f32, may then differ at near ties)",
    )  # fmt: skip
    parser.add_argument(
        "--allow-cpu", action="store_true", help="without an Intel GPU: the plugin on Intel's OpenCL CPU runtime"
    )
    parser.add_argument(
        "--model", default=None, help="an embedded model (default smollm2-135m; gemma3-270m), a GGUF or an HF folder"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the runs as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.allow_cpu:
        reason = emulation.unavailable()
        if reason:
            print(f"plugin_check: {reason}", file=sys.stderr)
            return 2
        emulation.enable()  # before any OpenCL call: a real Intel GPU is still listed first
    from ov_kvcrush.models.export import export_model
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine
    from ov_kvcrush.tools.model_coverage import F32

    methods = args.methods.split(",")
    try:
        compressions = read_compressions(methods, args.budget)
    except UserError as e:
        print(f"plugin_check: {e}", file=sys.stderr)
        return 2
    try:
        model_dir = export_model(args.model, weight_format="fp32", progress=False)
    except UserError as e:
        print(f"plugin_check: {e}", file=sys.stderr)
        return 2
    op = OpenVINOEngine(model_dir, kv_precision=args.kv_precision, properties=F32)
    prompt, settings = essay_prompt(args.chars), GenerationSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    ids = op.encode(prompt)
    wants = []
    for compression in compressions:
        op.set_compression(compression)
        wants.append(list(op.generate(prompt, settings).token_ids))
    try:
        runs = run_greedy(model_dir, ids, args.new_tokens, compressions, args.kv_precision, args.inference_precision)
    except (runtime.GPUPathError, UserError) as e:
        print(f"plugin_check: {e}", file=sys.stderr)
        return 2
    note = " (the emulation's times: they say nothing of a GPU)" if args.allow_cpu else ""
    print(f"{len(ids)}-token prompt, {args.new_tokens} greedy tokens, {args.kv_precision} KV, "
          f"{args.inference_precision} inference, device GPU "
          f"({runs[0].device}), compile {runs[0].compile_s:.1f} s{note}")  # fmt: skip
    rows = []
    for method, run, want in zip(methods, runs, wants, strict=True):
        crossed = sum(run.crossed_per_step.values())
        share = 100 * crossed / max(run.kv_read_per_step, 1)
        print(f"{method:24s} tokens {'equal to' if run.tokens == want else 'NOT equal to'} the CPU op's; TTFT "
              f"{run.prompt_ms:.0f} ms, TPOT {run.decode_ms:.0f} ms, KV {run.kv_bytes} B; per decode step "
              f"{crossed:.0f} B crossed, {share:.2f} % of the {run.kv_read_per_step:.0f} KV bytes read")  # fmt: skip
        rows.append({"method": method, **asdict(run), "equal_to_cpu_op": run.tokens == want, "crossed_pct": share})
    if args.out:
        command = " ".join([parser.prog, *(sys.argv[1:] if argv is None else argv)])
        text = json.dumps({"command": command, "prompt_tokens": len(ids), "runs": rows}, indent=1) + "\n"
        write_atomic(args.out, lambda tmp: tmp.write_text(text))
    return 0 if all(r["equal_to_cpu_op"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
