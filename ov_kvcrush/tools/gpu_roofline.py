"""An estimate, not a measurement: the bytes a decode step on ``device="GPU"`` reads, and the
time those bytes take at a GPU's memory bandwidth, for the full cache and each seed method at a
budget, beside native OpenVINO GenAI's full cache.

``python -m ov_kvcrush.tools.gpu_roofline [--budget 1024] [--out FILE.json]`` prints a markdown
table (docs/intel_gpu.md holds it) for SmolLM2-135M (the embedded model, f16 weights) and a
Llama-3.1-8B shape (int4 weights with a f16 scale per 128: what fits a 12 GB card), on an Arc
B580 (456 GB/s) and a Core Ultra iGPU (about 120 GB/s).

A decode step is memory bound: it reads every weight once and the KV bytes its attention and its
method touch. The time is bytes / bandwidth, a lower bound (no compute, no launch overhead, no
cache reuse). What each method touches a step, per layer and KV head, is what our ``device="GPU"``
path does today (``ov_kvcrush/gpu/layer_cache.py``, ``quant_cache.py``), not what it could do:

* full (ours and native's): every held slot's key and value;
* StreamingLLM: the budget's slots, and at each step past the budget the window's oldest slot
  dropped in place: the window after it moved down (read and written: about every kept slot);
* H2O, SnapKV, PyramidKV: the budget's slots, and the eviction of one slot a head in place: the
  slots after the dropped one move down (read and written; half the kept slots on average, the
  estimate's count), and the scores kept (the step's probabilities, from the logits the
  attention layer wrote, added; summed to find the lowest; moved with their slots:
  ``SCORE_PASSES`` float reads and writes a slot and query head);
* Knorm: as H2O, with no probabilities added;
* block-wise KVCrush: its selection is the prompt's alone: the budget's slots, and the scores it
  keeps (and, as tokens are generated, those too: not counted);
* MiniKV: the 2-bit chunks (``QuantShape.block_bytes`` a chunk) and the full-precision tail
  (the pinned prompt tail and the residual, at most a chunk), and its scores; no eviction (its
  selection is frozen).

Chelsea (``gpu/chelsea_cache.py``, the model's merge layer) reads its merged heads' slots (the
budget, and up to the merge interval more: half of it on average) with each slot's degree (f32),
and every ``merge_interval`` steps merges them (their slots read for the matching and the sums,
written back and moved: four passes, spread over the interval); its outlier heads (the
calibration's 4 % of heads) keep every token and count against the budget, so the merged heads
fall toward their floor as the context grows (``merged_budget``).

The recall methods keep every token and read a part of it a step, so their step grows with the
context (slowly: what they rank is a cluster's or a page's, not a token's), and their first
``dense_layers`` layers (2, their default) read every slot as the full cache does:

* ClusterKV (``gpu/recall_cache.py``, the model's recall layer): every centroid (f32) and the
  clusters' sizes and offsets, the recalled slots' ids, the sinks, the recalled slots and the
  pending ones (half of ``cluster_every`` on average), the list written and read back; the
  k-means every ``cluster_every`` steps is left out (a few hundred keys once per 320 steps);
* Quest (``gpu/quest_cache.py``, the model's pages layer): every page's key bounds (two f32
  vectors), the newest page's keys again for its bounds, the slots of the kept pages, the list
  written and read back.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ov_kvcrush.gpu.layout import PoolShape, QuantShape

#: (name, GB/s): the GPUs the estimate is for
GPUS = (("Arc B580", 456.0), ("Core Ultra iGPU", 120.0))
#: the methods estimated beside the full cache (budget-bound), in the table's order
METHODS = ("streamingllm", "snapkv", "knorm", "kvcrush", "minikv")
#: the methods that merge, after them (their outlier heads keep every token)
MERGING_METHODS = ("chelsea",)
#: the recall methods estimated after them (every token kept, a part of it read a step)
RECALL_METHODS = ("clusterkv", "quest")
#: float reads and writes of a slot's score per query head a step for the scoring methods: the
#: logits written and read back, the sums read and written, read to find the lowest, half of
#: them moved (read, write)
SCORE_PASSES = 5
#: MiniKV's store as the methods' defaults: 2-bit chunks of 128 tokens, groups of 16, 64 pinned
QUANT_CHUNK, QUANT_GROUP, PINNED = 128, 16, 64


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its attention layers and heads, and its weights."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: int
    weight_bits: float  # bits read a weight (int4 with a f16 scale per 128: 4.125)
    context: int  # the longest prompt estimated

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.weight_bits / 8)


def params_of(config: dict) -> int:
    """A decoder's weights from its HF ``config.json``: embeddings, each layer's attention and
    gated MLP, the output head where it is not tied (norms left out: a rounding error)."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    attention = h * d * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    mlp = 3 * h * config["intermediate_size"]
    head = 0 if config.get("tie_word_embeddings") else vocab * h
    return vocab * h + layers * (attention + mlp) + head


def shape_of(name: str, config: dict, weight_bits: float, context: int) -> ModelShape:
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelShape(name, config["num_hidden_layers"], config["num_attention_heads"],
                      config["num_key_value_heads"], d, params_of(config), weight_bits, context)  # fmt: skip


#: Llama-3.1-8B's shape (its config.json's fields)
LLAMA_31_8B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip


def kv_step_bytes(method: str, model: ModelShape, held: int, budget: int, kv_precision: str = "f16") -> int:
    """The KV bytes one decode step reads and writes over a context of ``held`` tokens (all
    layers and KV heads), as the module's docstring lists them."""
    fp = PoolShape(kv_precision, 16, model.head_dim, model.q_heads // model.kv_heads)
    slot = 2 * model.head_dim * fp.elem_bytes
    score = 4 * fp.group  # a slot's float score in each query head of the group
    kept = min(held, budget)
    if method == "full":
        per_head = held * slot
    elif method == "streamingllm":
        per_head = kept * slot + 2 * kept * slot
    elif method in ("snapkv", "h2o", "pyramidkv"):
        per_head = kept * slot + kept * slot + SCORE_PASSES * kept * score  # half the slots read and written
    elif method == "knorm":
        per_head = kept * slot + kept * slot + (SCORE_PASSES - 3) * kept * score  # no probabilities
    elif method == "kvcrush":
        per_head = kept * slot + 3 * kept * score
    elif method == "minikv":
        q = QuantShape(QUANT_CHUNK, model.head_dim, QUANT_GROUP, 2, 2, fp.group)
        quantized = max(kept - PINNED, 0) // QUANT_CHUNK * QUANT_CHUNK
        two_bit = quantized // QUANT_CHUNK * q.block_bytes
        per_head = two_bit + (kept - quantized) * slot + 3 * kept * score
    elif method in MERGING_METHODS:
        return _merging_step_bytes(model, held, budget, slot)
    elif method in RECALL_METHODS:
        return _recall_step_bytes(method, model, held, budget, slot)
    else:
        raise ValueError(f"method {method!r}: one of full, {', '.join(METHODS + MERGING_METHODS + RECALL_METHODS)}")
    return model.layers * model.kv_heads * per_head


def _merging_step_bytes(model: ModelShape, held: int, budget: int, slot: int) -> int:
    """:func:`kv_step_bytes` of Chelsea at its defaults (the module's docstring)."""
    from ov_kvcrush.methods.chelsea import OUTLIER_RATIO, ChelseaConfig, merged_budget

    cfg = ChelseaConfig(budget=budget)
    heads = model.layers * model.kv_heads
    outliers = int(OUTLIER_RATIO * heads + 0.5)  # as calibrate_outlier_heads rounds
    target = merged_budget(budget, held, heads, outliers, cfg.sink_tokens + cfg.recent_tokens + 1)
    g = cfg.merge_interval
    merges = held >= target + g
    attended = min(held, target + g // 2) if merges else held
    merged = attended * (slot + 4) + (4 * (target + g) * slot // g if merges else 0)
    return outliers * held * slot + (heads - outliers) * merged


def _recall_step_bytes(method: str, model: ModelShape, held: int, budget: int, slot: int) -> int:
    """:func:`kv_step_bytes` of ClusterKV or Quest at their defaults (the module's docstring)."""
    from ov_kvcrush.methods.clusterkv import ClusterKVConfig
    from ov_kvcrush.methods.quest import QuestConfig

    d = model.head_dim
    if method == "clusterkv":
        cfg = ClusterKVConfig(budget=budget)
        clusters = cfg.prompt_clusters(max(held - cfg.sink_tokens, 0))
        attended = min(held, budget + cfg.cluster_every // 2)
        index = clusters * (4 * d + 2 * 4) + budget * 4  # centroids, sizes and offsets, recalled ids
        per_head = index + attended * slot + 2 * 4 * attended
        dense = cfg.dense_layers
    else:
        quest = QuestConfig(budget=budget)
        pages = -(-held // quest.page_size)
        attended = min(held, budget)
        per_head = pages * 2 * 4 * d + quest.page_size * slot // 2 + attended * slot + 2 * 4 * attended
        dense = quest.dense_layers
    dense = min(dense, model.layers)
    return model.kv_heads * (dense * held * slot + (model.layers - dense) * per_head)


@dataclass(frozen=True)
class Row:
    model: str
    context: int
    method: str
    weight_bytes: int
    kv_bytes: int
    ms: dict[str, float]  # per GPU: the step's bytes at its bandwidth

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


def estimate(models: list[ModelShape], budget: int, contexts: dict[str, list[int]]) -> list[Row]:
    rows = []
    for model in models:
        for context in contexts[model.name]:
            for method in ("full", *METHODS, *MERGING_METHODS, *RECALL_METHODS):
                kv = kv_step_bytes(method, model, context, budget)
                total = model.weight_bytes + kv
                ms = {gpu: 1e3 * total / (bandwidth * 1e9) for gpu, bandwidth in GPUS}
                rows.append(Row(model.name, context, method, model.weight_bytes, kv, ms))
    return rows


def table(rows: list[Row], budget: int) -> str:
    """The rows as markdown, each method's bytes beside the full cache's (native's the same)."""
    head = (
        "| model | context | method | weights MB | KV MB | step MB | "
        + " | ".join(f"{gpu} ms" for gpu, _ in GPUS)
        + " | of native full's step |"
    )
    lines = [head, "|" + "---|" * (7 + len(GPUS))]
    full = {(r.model, r.context): r.total for r in rows if r.method == "full"}
    for r in rows:
        name = "full (ours, native's)" if r.method == "full" else f"{r.method} @{budget}"
        times = " | ".join(f"{r.ms[gpu]:.1f}" for gpu, _ in GPUS)
        share = r.total / full[(r.model, r.context)]
        lines.append(f"| {r.model} | {r.context:,} | {name} | {r.weight_bytes / 1e6:,.0f} | {r.kv_bytes / 1e6:,.1f} | "
                     f"{r.total / 1e6:,.0f} | {times} | {share:.2f} |")  # fmt: skip
    return "\n".join(lines)


def default_models() -> tuple[list[ModelShape], dict[str, list[int]]]:
    """SmolLM2-135M (the embedded model's config, f16 weights, to its 8k context) and the
    Llama-3.1-8B shape (int4 weights, to 128k)."""
    from ov_kvcrush.models.export import ensure_default_model

    smol = json.loads((ensure_default_model("fp32", progress=False) / "config.json").read_text())
    models = [shape_of("SmolLM2-135M", smol, 16, 8192), shape_of("Llama-3.1-8B", LLAMA_31_8B, 4.125, 131072)]
    return models, {"SmolLM2-135M": [8192], "Llama-3.1-8B": [8192, 32768, 131072]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ov_kvcrush.tools.gpu_roofline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--budget", type=int, default=1024, help="tokens each method keeps (default 1024)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.budget < 1:
        parser.error(f"--budget must be at least 1, got {args.budget}")
    models, contexts = default_models()
    rows = estimate(models, args.budget, contexts)
    print(table(rows, args.budget))
    if args.out:
        from ov_kvcrush.outputs import write_atomic

        payload = {"estimate": True, "budget": args.budget, "gpus": dict(GPUS),
                   "models": [asdict(m) for m in models], "rows": [asdict(r) for r in rows]}  # fmt: skip
        write_atomic(args.out, lambda p: p.write_text(json.dumps(payload, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
