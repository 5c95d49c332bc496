"""One-layer models of our GPU plugin layers (:mod:`~ov_kvcrush.gpu.plugin_layers`): a decode step
of one sequence, a step of several, and one over the 2-bit store, each the layers alone over
their parameters, compiled on the GPU plugin; what the layers' tests run under the emulation
(the whole model's layers are put in by ``transformations/plugin_attention.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ov_kvcrush.gpu.layer_inputs import STEP_FIELDS, TOKEN_FIELDS
from ov_kvcrush.gpu.plugin_layers import KERNELS, LayerAttributes, layer_class, write_config

# Imported where used, inside functions: what pulls in openvino, heavy to import, so that importing
# this module stays light.


def compile_step_model(core: object, folder: Path, attributes: LayerAttributes, model: object) -> object:
    """``model`` (one of the step models below) compiled on ``core``'s ``GPU`` in f32, the layers'
    ``CONFIG_FILE`` for ``attributes`` written into ``folder`` first."""
    core.set_property("GPU", {"CONFIG_FILE": str(write_config(folder, attributes))})  # type: ignore[attr-defined]
    return core.compile_model(model, "GPU", {"INFERENCE_PRECISION_HINT": "f32"})  # type: ignore[attr-defined]


def _step_parameters(attributes: LayerAttributes, kv_heads: int, q_shape: list[int]) -> dict:
    from openvino import opset13 as ops

    d = attributes.shape.head_dim
    shapes = {
        "q": (q_shape, np.float32),
        "k": ([kv_heads, -1, d], np.float32),
        "v": ([kv_heads, -1, d], np.float32),
        "pool": ([-1], np.uint8),
        "tables": ([-1, -1], np.int32),
        "first": ([-1], np.int32),
        "lengths": ([-1], np.int32),
        "tokens": ([-1, TOKEN_FIELDS], np.int32),
        "step": ([len(STEP_FIELDS)], np.int32),
        "logits": ([-1], np.uint8),  # written where step's logit_stride is set
    }
    if attributes.quant is not None:
        shapes |= {
            "qpool": ([-1], np.uint8),
            "qtables": ([-1, -1], np.int32),
            "qlengths": ([-1], np.int32),
            "flush": ([-1, 2], np.int32),
        }
    return {name: ops.parameter(shape, dtype, name=name) for name, (shape, dtype) in shapes.items()}


def _chain(attributes: LayerAttributes, params: dict, layers: tuple[str, ...], outputs: dict | None = None) -> dict:
    """Each layer of ``layers`` in turn, its inputs by name from the parameters and the outputs
    before it (a layer's output is named as the next layers' input: stored, logits, probs; or as
    ``outputs`` names it)."""
    names = {"OvkcStore": "stored", "OvkcFlush": "stored", "OvkcLogits": "logits", "OvkcSoftmax": "probs"}
    names |= outputs or {}
    values = {name: p.output(0) for name, p in params.items()}
    attrs = attributes.as_dict()
    for name in layers:
        node = layer_class(name)([values[i] for i in KERNELS[name].inputs], attrs)
        values[names.get(name, "out")] = node.output(0)
    return values


def decode_step_model(attributes: LayerAttributes, kv_heads: int) -> object:
    """One layer's decode step of one sequence as a model of the store and decode attention's
    three passes. Inputs: ``q`` [q_heads, D] (the query heads a dynamic dimension: the plugin
    gives a static custom layer a 4-D output its Result refuses), ``k`` and ``v`` [kv_heads, 1, D]
    (the step's), ``pool`` (uint8 bytes, written in place), ``tables`` [kv_heads, width] (block
    ids), ``first`` [kv_heads] (each head's first new slot), ``lengths`` [kv_heads] (its slots
    after the step), ``tokens`` (:func:`token_tensor`: ``[[0, 0, 0]]``), ``step``
    (:func:`step_tensor`). Outputs: the attention [q_heads, D] and the probabilities [q_heads,
    width * block_size]."""
    import openvino as ov

    params = _step_parameters(attributes, kv_heads, [-1, attributes.shape.head_dim])
    values = _chain(attributes, params, ("OvkcStore", "OvkcLogits", "OvkcSoftmax", "OvkcValues"))
    return ov.Model([values["out"], values["probs"]], list(params.values()), "ovkc_decode_step")


def _scored_parameters(attributes: LayerAttributes, kv_heads: int) -> dict:
    """A step's parameters with the rows layer's: ``score_rows`` [R] (int64: the step's rows the
    methods score, each sequence's adjacent) and ``rows`` (bytes, written in place)."""
    from openvino import opset13 as ops

    params = _step_parameters(attributes, kv_heads, [-1, -1, attributes.shape.head_dim])
    params["score_rows"] = ops.parameter([-1], np.int64, name="score_rows")
    params["rows"] = ops.parameter([-1], np.uint8, name="rows")
    return params


#: the rows layer's inputs of a step whose rows no method scores (the model's own say one row)
NO_SCORE_ROWS = {"score_rows": np.zeros(1, np.int64)}


def rows_input(q_heads: int, head_dim: int, rows: int = 1) -> np.ndarray:
    """The bytes of a step's ``rows`` input for ``rows`` score rows (f32 [q_heads, rows, head_dim])."""
    return np.zeros(4 * q_heads * rows * head_dim, np.uint8)


def prefill_step_model(attributes: LayerAttributes, kv_heads: int) -> object:
    """One layer's step of several sequences (a prompt's chunk beside decode tokens, each
    sequence's tokens adjacent) as a model of the store, the prompt layer and the rows layer (the
    score rows into ``rows``, their window sums where ``step`` asks, a step of decode rows alone's
    partitions merged: the whole model's order): inputs as :func:`decode_step_model`'s, with
    ``q`` [q_heads, T, D], ``k``, ``v`` [kv_heads, T, D], the cache's tensors a row per
    (sequence, KV head), ``score_rows`` and ``rows`` (:func:`_scored_parameters`); output the
    attention [q_heads, T, D]."""
    import openvino as ov

    params = _scored_parameters(attributes, kv_heads)
    values = _chain(attributes, params, ("OvkcStore", "OvkcPrefill", "OvkcRows"), {"OvkcPrefill": "attended"})
    return ov.Model([values["out"]], list(params.values()), "ovkc_prefill_step")


def quant_step_model(attributes: LayerAttributes, kv_heads: int) -> object:
    """:func:`prefill_step_model` over the 2-bit store (``attributes.quant``): the store, the
    flush, the prompt layer over both pools and the rows layer; inputs as :func:`prefill_step_model`'s and
    ``qpool`` (the 2-bit blocks' bytes, written in place), ``qtables`` [rows, width] (each row's
    2-bit blocks after the step), ``qlengths`` [rows] (its 2-bit slots after the step), ``flush``
    [rows, 2] (the full-precision slots the step quantizes: first, count)."""
    import openvino as ov

    if attributes.quant is None:
        raise ValueError("quant_step_model needs attributes.quant (the 2-bit blocks' shape)")
    params = _scored_parameters(attributes, kv_heads)
    values = _chain(attributes, params, ("OvkcStore", "OvkcFlush", "OvkcQuantPrefill", "OvkcRows"),
                    {"OvkcQuantPrefill": "attended"})  # fmt: skip
    return ov.Model([values["out"]], list(params.values()), "ovkc_quant_step")
