"""Helpers shared by the test modules (no test module imports another; they import this).

* Step-by-step runners for the OpenVINO tests: the unmodified stateful IR vs the converted one.
  Both are fed the same tokens (a prompt, then the greedy token of the *reference* at each step,
  so one divergence cannot cascade) and return the last position's logits after every step.
* A one-op model of our ``PagedAttention`` and drivers that feed it and a reference layer cache
  the same vectors (the op-vs-reference parity tests of every method).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from ov_kvcrush.transformations import convert_model

from ov_kvcrush import plugin
from ov_kvcrush.method_spec import method_spec
from ov_kvcrush.methods.vectors import layer_vectors

#: Exact f32 execution on both sides: no bf16 matmuls, and no dynamic quantization of activations
#: for int8 weights (the plugin picks it per graph, so the two graphs would differ by ~2 % in the
#: logits for reasons that have nothing to do with attention).
F32 = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def native_steps(xml: Path, prompt: list[int], steps: int, kv_precision: str, feed: list[int] | None = None):
    """Logits [steps + 1, vocab] of the unmodified model (OpenVINO's SDPA and state), greedy tokens."""
    import openvino as ov

    core = ov.Core()
    req = core.compile_model(core.read_model(xml), "CPU", {**F32, "KV_CACHE_PRECISION": kv_precision})
    req = req.create_infer_request()
    req.reset_state()
    out, tokens, past, ids = [], [], 0, list(prompt)
    for step in range(steps + 1):
        n = len(ids)
        req.infer(
            {
                "input_ids": np.asarray([ids], dtype=np.int64),
                "attention_mask": np.ones((1, past + n), dtype=np.int64),
                "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
        )
        past += n
        logits = np.array(req.get_output_tensor(0).data[0, -1], dtype=np.float32)
        out.append(logits)
        tokens.append(int(np.argmax(logits)))
        ids = [feed[step] if feed is not None else tokens[-1]]
    return np.stack(out), tokens


def converted_steps(xml: Path, prompt: list[int], feed: list[int], kv_precision: str, block_size: int = 32):
    """Logits of the converted model fed ``prompt`` then each token of ``feed``; and the pool."""
    import openvino as ov

    core = ov.Core()
    core.add_extension(str(plugin.loaded_path()))
    conv = convert_model(core.read_model(xml), plugin.loaded_path())
    req = core.compile_model(conv.model, "CPU", F32).create_infer_request()
    s = conv.shape
    pool = plugin.KVPool(s.layers, s.q_heads, s.kv_heads, s.head_dim, block_size=block_size, precision=kv_precision)
    seq = pool.new_sequence()
    names = {i.get_any_name() for i in req.model_inputs}
    out, past, ids = [], 0, list(prompt)
    for step in range(len(feed) + 1):
        n = len(ids)
        inputs = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
            "kvc_sequence": np.asarray([seq.handle], dtype=np.int64),
        }
        if "attention_mask" in names:
            inputs["attention_mask"] = np.ones((1, past + n), dtype=np.int64)
        req.infer(inputs)
        past += n
        out.append(np.array(req.get_output_tensor(0).data[0, -1], dtype=np.float32))
        if step < len(feed):
            ids = [feed[step]]
    return np.stack(out), conv, pool, seq


HQ, HKV, D = 9, 3, 64  # the embedded model's attention shape


def op_model(core, hq: int, hkv: int, d: int, layer: int = 0, scale: float | None = None, compute: str = "f32"):
    import openvino as ov
    import openvino.opset13 as ops
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(plugin.loaded_path()))
    q = ops.parameter([-1, hq, -1, d], np.float32, name="q")
    k = ops.parameter([-1, hkv, -1, d], np.float32, name="k")
    v = ops.parameter([-1, hkv, -1, d], np.float32, name="v")
    s = ops.parameter([-1], np.int64, name="kvc_sequence")
    node = factory.create(
        "PagedAttention",
        [q.output(0), k.output(0), v.output(0), s.output(0)],
        {"layer": layer, "scale": scale if scale is not None else 1 / math.sqrt(d), "compute": compute},
    )
    return core.compile_model(ov.Model([node.output(0)], [q, k, v, s]), "CPU").create_infer_request()


def held_positions(seq: plugin.KVSequence, layer: int) -> list[np.ndarray]:
    return [seq.read_head(layer, g)[0] for g in range(HKV)]


def drive(core, cfg, *, layer, steps, seed=0, layers=4, precision="f32", block_size=32):
    """Feed ``steps`` (token counts; the first is the prompt) to the op and the reference layer cache."""
    lv = layer_vectors(seed, kv_heads=HKV, q_heads=HQ, tokens=sum(steps), head_dim=D)
    pool = plugin.KVPool(
        layers, HQ, HKV, D, block_size=block_size, precision=precision, method=method_spec(cfg, layers, HQ, block_size)
    )
    seq = pool.new_sequence()
    req = op_model(core, HQ, HKV, D, layer=layer)
    lc = cfg.make_layer(layer, layers)
    a = 0
    for s, n in enumerate(steps):
        q, k, v = lv.queries[:, :, a : a + n], lv.keys[:, :, a : a + n], lv.values[:, :, a : a + n]
        a += n
        out = req.infer({"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kvc_sequence": np.array([seq.handle])})[0]
        ref = lc.prefill(q, k, v) if s == 0 else lc.decode(q, k, v)
        yield s, np.array(out), ref.numpy(), seq, pool, lc
