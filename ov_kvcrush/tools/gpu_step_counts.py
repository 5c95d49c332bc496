"""What a decode step of several sequences on ``device="GPU"`` asks of the GPU, counted, not timed:
issue 71's targets at their own size (4 sequences of 8k tokens each, budget 1024), which the
counts test (``tests/test_gpu_plugin_counts.py``: one sequence of 1,500 tokens) holds small.

``python -m ov_kvcrush.tools.gpu_step_counts [--sequences 4] [--tokens 8000] [--budget 1024]
[--methods full,snapkv,...] [--steps 16] [--out FILE.json]`` runs the family checks' tiny random-weight
Llama 3 (2 layers, 2 KV heads of 32 dims; the counts are per layer and per byte read, so the
model's size matters little) through the one loop on ``GPU``, under the emulation layer (which is
what counts: OpenVINO's GPU plugin on Intel's OpenCL CPU runtime). The sequences' prompts go in
together; once each has decoded, the next steps of every sequence's one token are counted: the
host's blocking waits, the bytes each way, our commands (kernels and device copies) a layer,
besides the one a step that writes the block tables' changes, and the KV bytes the step's
attention reads; by default over a block's worth of steps (``--steps 16``), in which every
sequence takes a block. Also the pool's blocks: held at most, and allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the methods counted by default, with their options (block-wise KVCrush, and token by token:
#: ``kvcrush/token``, every sequence selecting anew every step past the budget; MiniKV's 2-bit
#: chunks, and SnapKV's over them, ``snapkv/quant``, which evicts whole chunks; ClusterKV and
#: Quest recalling in every layer of the two, and ClusterKV clustering the new tokens every
#: second step, ``clusterkv/every2``; Chelsea, its decode merges a layer of the model); a label
#: is the method's name, then after a ``/`` what
#: tells its options apart
METHODS = {
    "full": {},
    "streamingllm": {},
    "snapkv": {},
    "h2o": {},
    "knorm": {},
    "kvcrush": {"block_size": 16},
    "kvcrush/token": {},
    "minikv": {"quant": {"residual_tokens": 16, "prompt_tail": 12}},
    "snapkv/quant": {"quant": {"residual_tokens": 16, "prompt_tail": 3}},
    "clusterkv": {"dense_layers": 0},
    "clusterkv/every2": {"dense_layers": 0, "cluster_every": 2, "new_clusters": 2},
    "quest": {"dense_layers": 0},
    "chelsea": {},
}
BLOCK, MEASURED_STEPS = 16, 16
#: the prefix of the folder a long-context checkpoint is written in before it is renamed into place
STAGING_PREFIX = ".tmp-long-context-"


def step_prompts(sequences: int, tokens: int) -> list[list[int]]:
    """The counted sequences' prompts: ``tokens`` random ids each."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(10, 380, tokens)] for _ in range(sequences)]


def count_steps(
    model_dir: str, methods: list[str], sequences: int, tokens: int, budget: int, precision: str, measured: int,
    kv_precision: str = "f16",
) -> list[dict]:  # fmt: skip
    """Per method (a label of :data:`METHODS`): each counted decode step's counts, the pool's
    blocks and each sequence's greedy tokens (run in a process where the emulation layer is on)."""
    from ov_kvcrush.config import CompressionConfig, GenerationSettings
    from ov_kvcrush.gpu import emulation
    from ov_kvcrush.gpu.table_mirror import TableMirror
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    once_a_step = {TableMirror.KERNEL}  # the tables' changes: one command a step, not a layer
    ours = emulation.own_kernels() - once_a_step
    engine = OpenVINOEngine(model_dir, device="GPU", kv_precision=kv_precision, block_size=BLOCK,
                            properties={"INFERENCE_PRECISION_HINT": precision})  # fmt: skip
    prompts = step_prompts(sequences, tokens)
    # one prompt enters a step: the first has decoded ``sequences`` tokens when the last starts
    settings = GenerationSettings(max_new_tokens=2 * sequences + measured + 2, ignore_eos=True)
    layers = engine.shape.layers
    out = []
    try:
        for label in methods:
            method = label.split("/")[0]
            full = method == "full"
            engine.set_compression(CompressionConfig(method=method, budget=None if full else budget,
                                                     options=METHODS.get(label, {})))  # fmt: skip
            loop, pool = engine.batcher, engine.pool
            handles = [loop.add_request(i, ids, settings) for i, ids in enumerate(prompts)]
            while loop.stats["decode_rows"] < 2 * sequences:  # each has decoded twice: the inputs re-laid
                loop.step()
            steps, most = [], 0
            for _ in range(measured):
                rows, read, before = loop.stats["decode_rows"], pool.decode_kv_read, emulation.counts()
                loop.step()
                c = emulation.counts() - before
                most = max(most, pool.stats().blocks_in_use)
                steps.append({
                    "decode_rows": loop.stats["decode_rows"] - rows, "waits": c.waits, "to_device": c.to_device,
                    "to_host": c.to_host, "ours_per_layer": (c.kernels_named(ours) + c.device_copies) / layers,
                    "ours_once_a_step": c.kernels_named(once_a_step),
                    "kv_read": pool.decode_kv_read - read, "layer_programs": c.layer_programs,
                    "our_kernels": {k: n for k, n in c.kernels.items() if k in ours | once_a_step},
                    "device_copies": c.device_copies,
                })  # fmt: skip
            while loop.has_non_finished_requests():
                loop.step()
            p = pool.device_pool
            out.append({"method": label, "steps": steps, "blocks_held_at_most": most, "blocks_allocated": p.capacity,
                        "chunk_blocks": p.chunk, "tokens": [list(h.result().token_ids) for h in handles],
                        "tokens_held_per_head": [h.result().counters["tokens_held_per_head"]
                                                 for h in handles]})  # fmt: skip
    finally:
        engine.close()
    return out


def long_checkpoint(tokens: int) -> Path:
    """The tiny Llama 3's checkpoint with a context of at least ``tokens`` tokens (its rotary
    embedding is computed from the positions, so the weights serve any length; a copy, cached)."""
    import shutil

    from ov_kvcrush.models.families import tiny_checkpoint
    from ov_kvcrush.models.staging import staging_dir

    source = tiny_checkpoint("llama3")
    context = 1 << max(tokens + 64, 1).bit_length()
    out = source.with_name(f"{source.name}-context{context}")
    if not (out / "config.json").is_file():
        with staging_dir(out.parent, STAGING_PREFIX) as tmp:  # whole or not at all
            stage = tmp / "hf"
            shutil.copytree(source, stage)
            config = json.loads((stage / "config.json").read_text())
            config["max_position_embeddings"] = context
            (stage / "config.json").write_text(json.dumps(config, indent=1))
            stage.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=MEASURED_STEPS, help="decode steps counted a method")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--inference-precision", default="f16", choices=["f16", "f32"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from ov_kvcrush.gpu import emulation
    from ov_kvcrush.models.export import export_models

    reason = emulation.unavailable()
    if reason:
        raise SystemExit(f"the emulation layer cannot run here: {reason}")
    checkpoint = long_checkpoint(args.tokens)
    model_dir = str(export_models([checkpoint], "fp32")[checkpoint])
    methods = [m for m in args.methods.split(",") if m]
    with emulation.worker() as worker:
        job = (model_dir, methods, args.sequences, args.tokens, args.budget, args.inference_precision, args.steps)
        rows = worker.submit(count_steps, *job).result()
    print("| method | decode rows a step | waits | bytes to the device (% of KV read) | bytes to the host | "
          "our commands a layer (and a step) | blocks allocated / held at most |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = max(r["steps"], key=lambda x: x["to_device"] / max(x["kv_read"], 1))  # the worst step
        share = 100 * s["to_device"] / max(s["kv_read"], 1)
        print(f"| {r['method']} | {s['decode_rows']} | {s['waits']} | {s['to_device']:,} ({share:.2f} %) | "
              f"{s['to_host']:,} | {max(x['ours_per_layer'] for x in r['steps']):g} "
              f"(+{max(x['ours_once_a_step'] for x in r['steps'])}) | "
              f"{r['blocks_allocated']} / {r['blocks_held_at_most']} (chunk {r['chunk_blocks']}) |")  # fmt: skip
    if args.out:
        command = "python -m ov_kvcrush.tools.gpu_step_counts " + " ".join(sys.argv[1:] if argv is None else argv)
        meta = {
            "command": command.strip(),
            "sequences": args.sequences,
            "tokens": args.tokens,
            "budget": args.budget,
            "steps": args.steps,
        }
        meta["inference_precision"] = args.inference_precision
        args.out.write_text(json.dumps(meta | {"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
