"""Where a long prompt's time goes: native ``openvino_genai``'s PagedAttention model beside our op's
model, on the same prompt. Native is split by OpenVINO's own counters (``PERF_COUNT``) into its
matmuls, its PagedAttention nodes and the rest; ours by the op's own clocks into the cache
writes, the attention, the per-head score pass and the method's own work, the rest of the wall
time being the model around the op (its matmuls, the layout changes to and from the op's f32).

Native is the exported IR after OpenVINO's SDPA-to-PagedAttention transformation, the LM head
on the last token only, compiled as ``openvino_genai`` compiles it on this CPU (u8 KV cache, the
plugin's default precision), the whole prompt in one inference (as the bench's ``genai`` engine
feeds it). It runs in a fresh process for each prompt length: the CPU plugin's per-node counters
are only consistent with the wall time (their sum within a few percent of it) while a compiled
model has seen one input shape. Ours is
:class:`~ov_kvcrush.serving.openvino_engine.OpenVINOEngine`'s prefill (two inferences: a
multiple of 128 tokens, then the rest), each method on its own pool of the same compiled model.
Every measurement follows an untimed warm-up of the same prompt.

Run on an idle machine::

    .venv/bin/python benchmarks/prefill_profile.py --lengths 2048,4096,8000 \\
        --json docs/results/bench/prefill_profile_cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from ov_kvcrush.bench.measure import cpu_name
from ov_kvcrush.config import MethodSpec
from ov_kvcrush.eval import tasks as T
from ov_kvcrush.op import plugin
from ov_kvcrush.serving.backends import resolve_model
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

METHODS = "full,snapkv,kvcrush:block_size=32,minikv,chelsea,h2o"
#: node types summed into one column: the projections and MLP, the attention, the rest
MATMULS = {"FullyConnected", "FullyConnectedCompressed", "MatMul"}
ATTENTION = {"PagedAttentionExtension"}
LAYOUT = {"Reorder", "Transpose", "Reshape", "Convert"}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def by_type(info: list[Any]) -> dict[str, float]:
    """ms per node type of one inference's profiling info (executed nodes only)."""
    out: dict[str, float] = defaultdict(float)
    for node in info:
        if node.status == ov.ProfilingInfo.Status.EXECUTED:
            out[node.node_type] += node.real_time.total_seconds() * 1e3
    return dict(out)


def columns(types: dict[str, float]) -> dict[str, float]:
    """Native's columns: matmuls, PagedAttention, layout changes, the other nodes, their sum."""
    mm = sum(v for k, v in types.items() if k in MATMULS)
    att = sum(v for k, v in types.items() if k in ATTENTION)
    lay = sum(v for k, v in types.items() if k in LAYOUT)
    rest = sum(types.values()) - mm - att - lay
    return {"matmul_ms": mm, "attention_ms": att, "layout_ms": lay, "other_ms": rest, "nodes_ms": sum(types.values())}


def last_token_logits(model: ov.Model) -> None:
    """The LM head on the last token only, as ``openvino_genai`` gathers it (else a prompt step
    computes and returns the logits of every position)."""
    node = model.get_results()[0].input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        node = node.input_value(0).get_node()
    hidden = node.input_value(0)  # [tokens, 1, hidden] after the PagedAttention transformation
    node.input(0).replace_source_output(ops.slice(hidden, [-1], [2**62], [1], [0]).output(0))
    model.validate_nodes_and_infer_types()


class Native:
    """The IR as ``openvino_genai`` runs it: PagedAttention nodes over a u8 block cache."""

    def __init__(self, model_dir: Path) -> None:
        core = plugin.shared_core()  # the process's one Core (see plugin.shared_core)
        model = core.read_model(model_dir / "openvino_model.xml")
        paged_attention_transformation(model)
        last_token_logits(model)
        self.compiled = core.compile_model(model, "CPU", {"PERF_COUNT": True, "KV_CACHE_PRECISION": "u8"})
        self.request = self.compiled.create_infer_request()
        self.caches = [i for i in self.compiled.inputs if "cache." in i.get_any_name()]

    def prefill(self, ids: list[int]) -> tuple[float, dict[str, float]]:
        n = len(ids)
        blocks = -(-n // 32) + 1
        for port in self.caches:
            shape = [blocks, *[d.get_length() for d in list(port.get_partial_shape())[1:]]]
            self.request.set_tensor(port, ov.Tensor(port.get_element_type(), shape))
        feed = {
            "input_ids": np.asarray(ids, dtype=np.int64),
            "position_ids": np.arange(n, dtype=np.int64),
            "past_lens": np.zeros(1, dtype=np.int32),
            "subsequence_begins": np.asarray([0, n], dtype=np.int32),
            "block_indices_begins": np.asarray([0, blocks], dtype=np.int32),
            "block_indices": np.arange(blocks, dtype=np.int32),
            "max_context_len": np.asarray(n, dtype=np.int32),
        }
        t0 = time.perf_counter()
        self.request.infer(feed)
        ms = (time.perf_counter() - t0) * 1e3
        return ms, by_type(self.request.profiling_info)


def native_prefill(model_dir: str, ids: list[int], repeats: int) -> list[tuple[float, dict[str, float]]]:
    """In a fresh worker process: ``repeats`` timed prefills of ``ids``, each after a warm-up."""
    native = Native(Path(model_dir))
    out = []
    for _ in range(repeats):
        native.prefill(ids)
        out.append(native.prefill(ids))
    return out


class Ours:
    """Our op's model, one method at a time, prefilled as ``generate`` prefills."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = OpenVINOEngine(model_dir)

    def prefill(self, method: str, ids: list[int], chunk: int = 0) -> dict[str, float]:
        """One prefill of ``ids``: as ``generate`` feeds a whole prompt, or (``chunk``) in steps of
        ``chunk`` tokens, as continuous batching feeds a long prompt beside other requests."""
        engine = self.engine
        engine.set_compression(MethodSpec.parse(method).compression(1024, track_recall=False))
        engine.finish_chat()  # an empty sequence
        t0 = time.perf_counter()
        if chunk:
            engine.sequence.set_prompt(len(ids))
            for i in range(0, len(ids), chunk):
                engine.forward(ids[i : i + chunk])
        else:
            engine.prefill(ids)
        engine.scoring_pass()
        ms = (time.perf_counter() - t0) * 1e3
        st = engine.sequence.stats()
        stages = {
            "append_ms": st.append_prefill_ns / 1e6,
            "attend_ms": st.attend_prefill_ns / 1e6,
            "scores_ms": st.scores_prefill_ns / 1e6,
            "policy_ms": st.policy_prefill_ns / 1e6,
        }
        engine.finish_chat()
        return {"wall_ms": ms, "model_ms": ms - sum(stages.values()), **stages}


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8000", help="prompt token counts")
    p.add_argument("--methods", default=METHODS, help="our op's methods (budget 1024)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-tokens", type=int, default=0, help="also feed each prompt in steps of this many tokens")
    p.add_argument("--model", default=None, help="an embedded model name or an exported directory")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    model_dir = Path(resolve_model("openvino", a.model))
    ours = Ours(model_dir)
    tok = ours.engine.tokenizer
    count = lambda t: len(tok.encode(t, add_special_tokens=False).input_ids.data[0])  # noqa: E731
    methods = [m for m in a.methods.split(",") if m]
    runs: dict[tuple[int, str], list[dict[str, float]]] = defaultdict(list)
    spawn = multiprocessing.get_context("spawn")
    for n in ints(a.lengths):
        ids = ours.engine.encode(T.GENERATION_TASKS["niah_single"](n + 64, count, 0, 0, 1).prompt)[-n:]
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            for ms, types in pool.submit(native_prefill, str(model_dir), ids, a.repeats).result():
                runs[(n, "native")].append({"wall_ms": ms, **columns(types)})
        configs = [(m, 0) for m in methods] + [(m, a.chunk_tokens) for m in methods if a.chunk_tokens]
        for r in range(a.repeats):  # our configurations interleaved, forward then backward
            for name, chunk in configs if r % 2 == 0 else configs[::-1]:
                ours.prefill(name, ids, chunk)  # warm-up
                runs[(n, f"{name} in chunks of {chunk}" if chunk else name)].append(ours.prefill(name, ids, chunk))
        for name in [k for length, k in runs if length == n]:
            row = median_row(runs[(n, name)])
            print(f"{n:>6} {name:<24} " + " ".join(f"{k}={v:.0f}" for k, v in row.items()), flush=True)
    results = [{"length": n, "config": name, **median_row(rows)} for (n, name), rows in runs.items()]
    doc = {
        "what": __doc__.splitlines()[0],
        "command": "python benchmarks/prefill_profile.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k != "json"),
        "machine": {"cpu": cpu_name(), "arch": platform.machine(), "openvino": ov.get_version()},
        "results": sorted(results, key=lambda x: (x["length"], x["config"] != "native", x["config"])),
        "runs": {f"{n} {name}": rows for (n, name), rows in runs.items()},
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
