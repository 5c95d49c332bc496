"""The exported model in OpenVINO's GPU plugin with our layers in place of its attention, the full
cache: the GPU form of the openvino backend's path, end to end, for one sequence.

The graph pass (:func:`~ov_kvcrush.transformations.plugin_attention.convert_model_for_plugin`)
puts the store and prefill layers in every layer; the pool is one remote tensor of the plugin's
context, and :class:`PluginModel` keeps its bookkeeping on the host (each KV head's blocks, the
slots' positions, the free blocks) and feeds it with each step. What it is for: checking our
layers in a whole model against the CPU op (``python -m ov_kvcrush.gpu.plugin_model``, greedy
tokens equal or not). The methods' selections over this pool and the serving loop over it are
not built (docs/intel_gpu.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ov_kvcrush.engines import model_inputs
from ov_kvcrush.errors import UserError
from ov_kvcrush.gpu import emulation, plugin_layers, runtime
from ov_kvcrush.gpu.layout import PoolShape


@dataclass
class FullCacheBlocks:
    """Every layer's KV heads' blocks in a pool of ``capacity`` blocks, all holding ``tokens``
    tokens (a full cache: slot j holds position j)."""

    layers: int
    kv_heads: int
    block_size: int
    capacity: int
    tokens: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.capacity - 1, -1, -1))
        self.tables = np.zeros((self.layers, self.kv_heads, 0), np.int32)

    def grow(self, new_tokens: int) -> None:
        """Blocks for ``new_tokens`` more tokens in every head (a :class:`UserError` when the pool
        runs out)."""
        width = math.ceil((self.tokens + new_tokens) / self.block_size)
        more = width - self.tables.shape[2]
        if more <= 0:
            return
        need = more * self.layers * self.kv_heads
        if need > len(self.free):
            raise UserError(f"the pool's {self.capacity} blocks are exhausted ({len(self.free)} free, {need} needed)")
        added = np.array([self.free.pop() for _ in range(need)], np.int32).reshape(self.layers, self.kv_heads, more)
        self.tables = np.concatenate([self.tables, added], axis=2)

    def step_inputs(self, new_tokens: int) -> dict[str, np.ndarray]:
        """The pass's cache inputs for a step of ``new_tokens`` (blocks grown first)."""
        self.grow(new_tokens)
        width = self.tables.shape[2]
        slots = width * self.block_size
        counts = np.full((self.layers, self.kv_heads), self.tokens, np.int32)
        positions = np.broadcast_to(np.arange(slots, dtype=np.int32), (self.layers, self.kv_heads, slots))
        return {
            "kvc_tables": self.tables,
            "kvc_first": counts,
            "kvc_lengths": counts + new_tokens,
            "kvc_positions": np.ascontiguousarray(positions),
            "kvc_step": plugin_layers.step_tensor(width, slots, self.tokens, new_tokens),
        }


class PluginModel:
    """``model_dir`` (an ``optimum-cli export openvino`` folder) on the plugin's ``GPU`` with our
    layers; ``kv_precision`` blocks of ``block_size`` tokens, a pool of ``pool_blocks`` blocks."""

    def __init__(self, model_dir: str | Path, *, kv_precision: str = "f32", block_size: int = 32,
                 pool_blocks: int = 2048, sub_group: int = 16) -> None:  # fmt: skip
        import openvino as ov

        from ov_kvcrush.models.embedded import cache_root
        from ov_kvcrush.op import plugin
        from ov_kvcrush.transformations.plugin_attention import convert_model_for_plugin

        core = plugin.shared_core()
        #: the plugin's device (a GPUPathError naming what is missing, before the compilation)
        self.device = emulation.plugin_device(core)
        model_dir = Path(model_dir)
        converted = convert_model_for_plugin(
            core.read_model(model_dir / "openvino_model.xml"),
            kv_precision=kv_precision,
            block_size=block_size,
            sub_group=sub_group,
        )
        s = converted.shape
        pool_shape = PoolShape(kv_precision, block_size, s.head_dim, s.q_heads // s.kv_heads)
        attributes = plugin_layers.LayerAttributes(pool_shape, sub_group, converted.scales[0])
        config = plugin_layers.write_config(cache_root() / "plugins" / "gpu-plugin-layers", attributes)
        core.set_property("GPU", {"CONFIG_FILE": str(config)})
        t0 = time.perf_counter()
        self.compiled = core.compile_model(converted.model, "GPU", {"INFERENCE_PRECISION_HINT": "f32"})
        self.compile_seconds = time.perf_counter() - t0
        self.request = self.compiled.create_infer_request()
        self.input_names = {p.get_any_name() for p in self.compiled.inputs}
        pool = core.get_default_context("GPU").create_tensor(
            ov.Type.u8, ov.Shape([pool_blocks * pool_shape.block_bytes]), {}
        )
        self.request.set_tensor("kvc_pool", pool)
        self.blocks = FullCacheBlocks(s.layers, s.kv_heads, block_size, pool_blocks)
        self.block_bytes = pool_shape.block_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes of the blocks the sequence holds (every layer's KV heads, keys and values)."""
        return int(self.blocks.tables.size) * self.block_bytes

    def forward(self, ids: list[int]) -> np.ndarray:
        """Feed ``ids`` after the cached tokens; the next-token logits."""
        import openvino as ov

        past, n = self.blocks.tokens, len(ids)
        # the model's own inputs as the CPU op's step feeds them (no sequence handle here)
        model = model_inputs.step_inputs(self.input_names, [ids], [0], [past])
        feeds = {name: x for name, x in model.items() if name in self.input_names} | self.blocks.step_inputs(n)
        for name, array in feeds.items():
            self.request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        self.request.infer()
        self.blocks.tokens += n
        return np.array(self.request.get_output_tensor(0).data[0, -1], np.float32)

    def greedy(self, ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """``new_tokens`` greedy tokens after the prompt ``ids`` (fed whole); with the prompt's
        step and the mean decode step, in seconds."""
        t0 = time.perf_counter()
        out = [int(np.argmax(self.forward(ids)))]
        prompt_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        while len(out) < new_tokens:
            out.append(int(np.argmax(self.forward([out[-1]]))))
        return out, prompt_s, (time.perf_counter() - t1) / max(new_tokens - 1, 1)


@dataclass
class PluginRun:
    """A greedy run through :class:`PluginModel`."""

    device: str
    tokens: list[int]
    compile_s: float
    prompt_ms: float
    decode_ms: float
    kv_bytes: int


def run_greedy(model_dir: str | Path, ids: list[int], new_tokens: int, kv_precision: str = "f32") -> PluginRun:
    """``new_tokens`` greedy tokens after ``ids`` through :class:`PluginModel`, in this process."""
    model = PluginModel(model_dir, kv_precision=kv_precision)
    tokens, prompt_s, step_s = model.greedy(ids, new_tokens)
    return PluginRun(model.device, tokens, model.compile_seconds, prompt_s * 1e3, step_s * 1e3, model.kv_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ov_kvcrush.gpu.plugin_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=1500, help="characters of essay in the prompt")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--kv-precision", choices=("f32", "f16", "u8"), default="f32")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="without an Intel GPU: the plugin on Intel's OpenCL CPU runtime"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.allow_cpu:
        reason = emulation.unavailable()
        if reason:
            print(f"plugin_model: {reason}", file=sys.stderr)
            return 2
        emulation.enable()  # before any OpenCL call: a real Intel GPU is still listed first
    from ov_kvcrush.config import CompressionConfig, GenerationSettings
    from ov_kvcrush.engines.openvino_engine import OpenVINOEngine
    from ov_kvcrush.gpu.generate import essay_prompt
    from ov_kvcrush.models.coverage import F32
    from ov_kvcrush.models.export import ensure_default_model

    model_dir = ensure_default_model("fp32", progress=False)
    op = OpenVINOEngine(model_dir, CompressionConfig(method="full"), kv_precision=args.kv_precision, properties=F32)
    prompt = essay_prompt(args.chars)
    ids = op.encode(prompt)
    want = op.generate(prompt, GenerationSettings(max_new_tokens=args.new_tokens, ignore_eos=True)).token_ids
    try:
        run = run_greedy(model_dir, ids, args.new_tokens, args.kv_precision)
    except runtime.GPUPathError as e:
        print(f"plugin_model: {e}", file=sys.stderr)
        return 2
    same = run.tokens == list(want)
    verdict = "equal to" if same else "NOT equal to"
    print(f"{len(ids)}-token prompt, {args.new_tokens} greedy tokens, {args.kv_precision} KV, full cache: through our "
          f"layers in the GPU plugin ({run.device}) {verdict} the CPU op's")  # fmt: skip
    times = f"compile {run.compile_s:.1f} s, prompt step {run.prompt_ms:.0f} ms, decode step {run.decode_ms:.0f} ms"
    print(times + (" (the emulation's: they say nothing of a GPU)" if args.allow_cpu else ""))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
