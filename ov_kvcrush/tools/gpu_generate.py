"""A real decode through the GPU path's kernels, beside the reference, and what crosses per step.

:func:`run_on_device` generates greedily with the torch engine whose cache lives in the device
pool (``TorchEngine(paged_device="opencl")``: the model's layers run in torch on the host, the
cache's steps in ``plugins/gpu``'s kernels) and, in the same process, with the reference cache,
so the two token lists can be compared. It runs where Intel's OpenCL runtime can load: a process
that prepared it before ``openvino`` was imported (the tests' ``gpu_worker``, or this module run
as a script).

``python -m ov_kvcrush.tools.gpu_generate --methods full,snapkv,kvcrush:block_size=32 --budget 1024``
prints, per method, whether the tokens equal the reference's and the bytes that crossed per
decode step and layer beside the KV bytes that step read in place (JSON with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ov_kvcrush.config import CompressionConfig, GenerationSettings, MethodSpec
from ov_kvcrush.corpus import essay_text, haystack_essays
from ov_kvcrush.gpu import HOSTS, runtime
from ov_kvcrush.gpu.pool import Crossings
from ov_kvcrush.methods import require
from ov_kvcrush.methods.runtimes import GPU_POOL

# Imported where used, inside functions: what pulls in platformdirs, transformers, heavy to import,
# so that importing this module stays light.

if TYPE_CHECKING:
    from ov_kvcrush.engines.base import GenerationResult
    from ov_kvcrush.engines.torch_engine import TorchEngine

#: every kind of config the path serves
DEFAULT_METHODS = (
    "full,snapkv,h2o,kvcrush,kvcrush:block_size=32,clusterkv,snapkv:quant=true,minikv,streamingllm,knorm,quest"
)

#: what a step crosses only because the model runs on the host here: its queries, keys and
#: values in, the attention output back (with the model on the device none of it crosses)
MODEL_TENSORS = ("queries", "step keys and values", "attention output")


@dataclass
class DeviceRun:
    """One prompt generated through the device cache and through the reference cache."""

    method: str
    options: dict
    prompt_tokens: int
    token_ids: list[int]
    reference_ids: list[int]
    kv_bytes: int
    reference_kv_bytes: int
    device_s: float
    reference_s: float
    prompt: Crossings
    decode: Crossings

    def per_step(self) -> dict[str, float]:
        """Per decode step and layer: bytes crossed each way, those of them that are the cache's
        own (block tables, counts, selection decisions: what crosses with the model on the
        device too), the KV bytes read in place, and the ratios."""
        steps = max(self.decode.layer_steps, 1)
        moved = {**self.decode.to_device, **{f"out:{k}": v for k, v in self.decode.to_host.items()}}
        own = sum(v for k, v in moved.items() if k.removeprefix("out:") not in MODEL_TENSORS) / steps
        read = self.decode.kv_read / steps
        return {
            "to_device": sum(self.decode.to_device.values()) / steps,
            "to_host": sum(self.decode.to_host.values()) / steps,
            "cache_own": own,
            "kv_read": read,
            "crossed_over_read": self.decode.total() / steps / read if read else 0.0,
            "cache_own_over_read": own / read if read else 0.0,
        }


def essay_prompt(chars: int) -> str:
    """The first ``chars`` characters of the haystack's essays (the second first, as the op's
    end-to-end tests use it) and a request for a long answer."""

    request = "\n\nSummarise the text above as a detailed list of its main points."
    essays = haystack_essays()
    text = "\n\n".join(essay_text(e) for e in essays[1:] + essays[:1])  # longer prompts: the next essays
    return text[:chars] + request


def device_engine(model_dir: str | Path, host: str = "opencl") -> TorchEngine:
    """The torch engine over ``model_dir`` with its caches in the device pool, hosted by ``host``
    (``opencl``: pyopencl; ``sycl``: the C++ SYCL host): loaded once, it serves every method's run
    (:func:`run_on_device` switches the method)."""
    runtime.prepare()
    from ov_kvcrush.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, paged_device=host)


def reference_runs(
    engine: TorchEngine, compressions: list[CompressionConfig], prompt: str, new_tokens: int
) -> list[GenerationResult]:
    """The reference cache's greedy ``new_tokens`` under each of ``compressions``, the prompt's
    forward pass shared (``TorchEngine.generate_each``: each result is ``generate``'s)."""
    engine.paged_device = None
    return engine.generate_each(prompt, compressions, GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True))


def run_on_device(
    engine: TorchEngine,
    compression: CompressionConfig,
    prompt: str,
    new_tokens: int,
    reference: GenerationResult | None = None,
    host: str = "opencl",
) -> DeviceRun:
    """Greedy ``new_tokens`` for ``prompt`` through the device cache, then the reference's, with
    ``engine`` (:func:`device_engine`) under ``compression``, the device hosted by ``host``.
    ``reference``: the reference's run already made (:func:`reference_runs`), else it is made here."""
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    engine.paged_device = host
    engine.set_compression(compression)  # a method the path does not serve is refused here
    t0 = time.perf_counter()
    got = engine.generate(prompt, settings)
    device_s = time.perf_counter() - t0
    crossings = engine.last_pool.crossings
    if reference is None:
        engine.paged_device = None  # the same loaded model, now through the reference cache
        t0 = time.perf_counter()
        reference = engine.generate(prompt, settings)
        reference_s = time.perf_counter() - t0
    else:
        reference_s = (reference.ttft_ms + reference.tpot_ms * (len(reference.token_ids) - 1)) / 1000
    return DeviceRun(
        method=compression.method,
        options=dict(compression.options),
        prompt_tokens=got.prompt_tokens,
        token_ids=got.token_ids,
        reference_ids=reference.token_ids,
        kv_bytes=got.kv_bytes,
        reference_kv_bytes=reference.kv_bytes,
        device_s=device_s,
        reference_s=reference_s,
        prompt=crossings["prompt"],
        decode=crossings["decode"],
    )


def markdown_table(paths: list[Path]) -> str:
    """The per-step table of ``docs/intel_gpu.md`` from runs this module wrote (``--out``)."""
    lines = [
        "| method | budget | greedy tokens equal the reference's | KV bytes read in place "
        "| the cache's own bytes crossed | all bytes crossed |",
        "|---|---|---|---|---|---|",
    ]
    seen = set()
    for path in paths:
        recorded = json.loads(path.read_text())
        budget = recorded["command"].split("--budget ")[1].split()[0]
        for run in recorded["runs"]:
            name = run["method"] + "".join(f":{k}={v}" for k, v in run["options"].items())
            if name == "full" and name in seen:
                continue  # the full cache has no budget: once
            seen.add(name)
            st = run["per_step"]
            crossed = st["to_device"] + st["to_host"]
            lines.append(
                f"| {name} | {'—' if name == 'full' else budget} | {'yes' if run['equal'] else 'no'} "
                f"| {st['kv_read']:,.0f} | {st['cache_own']:,.0f} ({100 * st['cache_own_over_read']:.2f} %) "
                f"| {crossed:,.0f} ({100 * st['crossed_over_read']:.2f} %) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ov_kvcrush.tools.gpu_generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated, each NAME or NAME:KEY=VALUE[:...]")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chars", type=int, default=8200, help="characters of essay in the prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--host", choices=HOSTS, default="opencl", help="the device's host: pyopencl or the SYCL host")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, nargs="+", help="print the table of these runs (JSON), run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(args.table))
        return 0
    from ov_kvcrush.models.export import hf_checkpoint

    engine = device_engine(hf_checkpoint(progress=False), args.host)
    prompt = essay_prompt(args.chars)
    methods = args.methods.split(",")
    compressions = []
    for method in methods:
        spec = MethodSpec.read(method)
        name, options = spec.method, spec.method_options()
        compressions.append(CompressionConfig(method=name, budget=args.budget, options=options))
    for compression in compressions:
        require(compression.method_config(), GPU_POOL.name)  # before any run: a method the path does not serve
    references = reference_runs(engine, compressions, prompt, args.new_tokens)
    rows = []
    for method, compression, reference in zip(methods, compressions, references, strict=True):
        run = run_on_device(engine, compression, prompt, args.new_tokens, reference, args.host)
        row = {**asdict(run), "equal": run.token_ids == run.reference_ids, "per_step": run.per_step()}
        rows.append(row)
        step = row["per_step"]
        print(
            f"{method:22s} prompt {run.prompt_tokens} tokens equal={row['equal']} per decode step and layer: "
            f"{step['to_device']:.0f} B in, {step['to_host']:.0f} B out ({step['cache_own']:.0f} B the cache's own), "
            f"KV read {step['kv_read']:.0f} B ({100 * step['crossed_over_read']:.2f} %, own "
            f"{100 * step['cache_own_over_read']:.3f} %); device {run.device_s:.1f} s, "
            f"reference {run.reference_s:.1f} s"
        )
    if args.out:
        command = " ".join([parser.prog, *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(json.dumps({"command": command, "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
