"""Replace SDPA + KV state in optimum's stateful IR with ``ov_kvcrush::PagedAttention``.

``optimum-cli export openvino`` writes, per layer::

    ReadValue(past_key) -> Gather(beam_idx) -> Concat(axis=-2) <- key of this step (after RoPE)
                                                  |-> Assign(past_key)
                                                  '-> [Unsqueeze -> Broadcast -> Reshape] (GQA) -> SDPA.key

and the same for values. :func:`convert_model` finds each SDPA, follows its key and value back
through the GQA expansion to those Concats, and wires the step's own keys/values (the Concat's
second input) into a ``PagedAttention`` node together with the query and a new ``kvc_sequence``
input (the cache handle). The Assigns are removed, and so are the variables, the attention mask
sub-graph and any input nothing reads any more (``beam_idx``; ``attention_mask`` on the models
tested). Everything else stays OpenVINO's. With ``last_token_logits`` the LM head sees only the
positions a ``kvc_logits_at`` input names (the last one of a step; in a ragged step of several
sequences, each one's last), as openvino_genai does, so a 4k-token prefill does not compute 4k ×
vocab logits.

Conversion happens in memory, on a model read by ``core.read_model``: the converted model can
be serialised and read back only by a Core that has the extension added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ov_kvcrush.errors import UserError
from ov_kvcrush.op.step_inputs import LOGITS_INPUT, SEQUENCE_INPUT  # the op's input contract

# Imported where used, inside functions: what pulls in openvino, heavy to import, so that importing
# this module stays light.

#: Ops between the KV Concat and the SDPA that only expand KV heads for grouped-query attention.
_GQA_OPS = ("Reshape", "Broadcast", "Unsqueeze", "Convert", "Tile", "Squeeze")
#: Ops between ReadValue and the Concat (beam reordering, precision).
_STATE_OPS = ("Gather", "Convert")
#: Element-wise ops allowed between the LM head's MatMul and the logits Result.
_HEAD_TAIL_OPS = ("Convert", "Multiply", "Divide", "Tanh", "Add")


class ConversionError(UserError):
    """The model does not have the pattern the pass converts; the message names what is missing."""


@dataclass(frozen=True)
class AttentionShape:
    """What the KV pool must be sized for, read from the converted SDPAs."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int


@dataclass
class ConvertedModel:
    """The converted model, its attention shape, the per-layer logit scales and what was removed."""

    model: object
    shape: AttentionShape
    scales: list[float]
    removed_inputs: list[str] = field(default_factory=list)
    removed_variables: int = 0


def _src(node, i: int = 0):
    return node.input(i).get_source_output()


def _static_dim(ps, idx: int, what: str, layer: int) -> int:
    dim = ps[idx]
    if dim.is_dynamic:
        raise ConversionError(f"layer {layer}: the {what} of ScaledDotProductAttention is dynamic ({ps}); need static")
    return dim.get_length()


def _find_state_concat(sdpa, port: int, layer: int):
    """The Concat(past, new) feeding SDPA input ``port`` through the GQA expansion, with its Assign."""
    what = "key" if port == 1 else "value"
    out = _src(sdpa, port)
    seen = []
    node = out.get_node()
    while node.get_type_name() in _GQA_OPS:
        seen.append(node.get_type_name())
        node = _src(node).get_node()
    if node.get_type_name() != "Concat":
        chain = " <- ".join([*seen, node.get_type_name()])
        raise ConversionError(
            f"layer {layer}: the {what} of ScaledDotProductAttention '{sdpa.get_friendly_name()}' does not come "
            f"from a KV-state Concat (found SDPA <- {chain}); export a stateful model with optimum-cli export openvino"
        )
    concat = node
    if concat.get_input_size() != 2:
        raise ConversionError(f"layer {layer}: the {what} Concat has {concat.get_input_size()} inputs, expected 2")
    axis = int(concat.get_attributes()["axis"])
    rank = concat.get_output_partial_shape(0).rank.get_length()
    if axis not in (rank - 2, -2):
        raise ConversionError(f"layer {layer}: the {what} Concat joins axis {axis}, expected the sequence axis -2")
    past = _src(concat, 0).get_node()
    while past.get_type_name() in _STATE_OPS:
        past = _src(past).get_node()
    if past.get_type_name() != "ReadValue":
        raise ConversionError(
            f"layer {layer}: the past {what} is not read from a ReadValue (found {past.get_type_name()}); "
            "the model is not a stateful KV-cache export"
        )
    assigns = [t.get_node() for t in concat.output(0).get_target_inputs() if t.get_node().get_type_name() == "Assign"]
    if not assigns:
        raise ConversionError(f"layer {layer}: the {what} Concat has no Assign: not a stateful KV-cache export")
    return concat, past, assigns


def _scale(sdpa, head_dim: int, layer: int) -> float:
    if sdpa.get_input_size() < 5:
        return 1.0 / math.sqrt(head_dim)
    node = _src(sdpa, 4).get_node()
    while node.get_type_name() == "Convert":
        node = _src(node).get_node()
    if node.get_type_name() != "Constant":
        raise ConversionError(f"layer {layer}: the ScaledDotProductAttention scale is not a constant")
    return float(np.asarray(node.get_data()).reshape(-1)[0])


def _reachable(model) -> set:
    """Nodes the results and sinks depend on."""
    seen: set = set()
    stack = [r for r in model.get_results()] + list(model.get_sinks())
    while stack:
        n = stack.pop()
        key = _node_key(n)
        if key in seen:
            continue
        seen.add(key)
        stack.extend(i.get_source_output().get_node() for i in n.inputs())
    return seen


def _node_key(node) -> int:
    """Identity of a graph node (Python wrappers are new objects on every access, so ``id`` is not)."""
    return node.get_instance_id()


def _gather_logit_positions(model, positions) -> bool:
    """Feed the LM head only the positions ``positions`` names: ``Gather(hidden, positions, axis=1)``
    before its MatMul (the last position of a step; each sequence's last one in a ragged step)."""
    import openvino.opset13 as ops

    result = model.get_results()[0]
    node = _src(result).get_node()
    while node.get_type_name() in _HEAD_TAIL_OPS and node.get_type_name() != "MatMul":
        node = _src(node).get_node()
    if node.get_type_name() != "MatMul":
        return False
    hidden = _src(node, 0)
    if hidden.get_partial_shape().rank.is_dynamic or hidden.get_partial_shape().rank.get_length() != 3:
        return False
    gathered = ops.gather(hidden, positions, np.array(1, dtype=np.int64))
    node.input(0).replace_source_output(gathered.output(0))
    return True


#: Arithmetic of the op's prefill dot products (decode is always f32).
COMPUTE = ("f32", "bf16")


def convert_model(
    model, library: str | Path, *, last_token_logits: bool = True, compute: str = "f32", softcap: float = 0.0
) -> ConvertedModel:
    """Convert ``model`` (an ``openvino.Model`` from optimum's stateful export) in place.

    Args:
        model: read with ``core.read_model``; modified in place and returned in the result.
        library: path of the CPU extension library (:func:`ov_kvcrush.op.plugin.loaded_path`).
        last_token_logits: compute logits only at the positions the ``kvc_logits_at`` input names
            (``[tokens - 1]`` for one sequence's step; each sequence's last token in a ragged step).
        compute: ``f32``, or ``bf16`` for prefill dot products in bf16 with fp32 accumulation (what
            OpenVINO's own SDPA does under a bf16 inference precision; the engine picks it from the
            plugin's ``INFERENCE_PRECISION_HINT``). Needs AVX512-BF16; otherwise f32 is used.
        softcap: the model's attention soft-capping (Gemma 2's ``attn_logit_softcapping``: each
            scaled logit becomes ``softcap * tanh(s / softcap)``); 0 for none. optimum's export
            drops it (its SDPA has no such input), so it comes from the model's ``config.json``.

    Raises:
        ConversionError: no ScaledDotProductAttention, or a key/value that does not come from
            the ReadValue → Concat → Assign state, or shapes the op cannot take; the message
            names the layer and what was found instead.
    """
    import openvino as ov
    import openvino.opset13 as ops

    if compute not in COMPUTE:
        raise ConversionError(f"compute={compute!r} is invalid: allowed {', '.join(COMPUTE)}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ConversionError(f"softcap={softcap!r} is invalid: allowed 0 (none) or a positive finite cap")
    plans, shape = layer_plans(model)
    seq = ops.parameter([-1], ov.Type.i64, name=SEQUENCE_INPUT)
    seq.output(0).get_tensor().set_names({SEQUENCE_INPUT})
    _replace_attention(model, plans, seq.output(0), library, {"compute": compute, "softcap": float(softcap)})
    model.add_parameters([seq])
    return finish_conversion(model, plans, shape, last_token_logits)


def layer_plans(model) -> tuple[list[LayerPlan], AttentionShape]:
    """Each layer's plan, and the attention shape every layer shares (refused when they differ)."""
    sdpas = _attention_ops(model)
    plans = [_plan_layer(layer, sdpa, len(sdpas)) for layer, sdpa in enumerate(sdpas)]
    shape = plans[0].shape
    for plan in plans[1:]:
        if plan.shape != shape:
            raise ConversionError(f"layer {plan.layer}: attention shape {plan.shape} differs from layer 0's {shape}")
    return plans, shape


def finish_conversion(model, plans: list[LayerPlan], shape: AttentionShape, last_token_logits: bool) -> ConvertedModel:
    """Drop the state and inputs nothing reads, gather the logits' positions, validate."""
    import openvino as ov
    import openvino.opset13 as ops

    removed_vars, removed = _drop_unused_state(model)
    if last_token_logits:
        logits_at = ops.parameter([-1], ov.Type.i64, name=LOGITS_INPUT)
        logits_at.output(0).get_tensor().set_names({LOGITS_INPUT})
        if not _gather_logit_positions(model, logits_at.output(0)):
            raise ConversionError(
                "the logits do not come from a MatMul over [batch, tokens, hidden]: cannot select positions"
            )
        model.add_parameters([logits_at])
    model.validate_nodes_and_infer_types()
    return ConvertedModel(
        model=model,
        shape=shape,
        scales=[p.scale for p in plans],
        removed_inputs=removed,
        removed_variables=removed_vars,
    )


def _attention_ops(model) -> list:
    """The model's ScaledDotProductAttention ops, in order; refuses a model without them."""
    sdpas = [op for op in model.get_ordered_ops() if op.get_type_name() == "ScaledDotProductAttention"]
    if not sdpas:
        kinds = sorted({op.get_type_name() for op in model.get_ordered_ops()})
        hint = (
            " (it already has PagedAttention: convert the exported IR, not a converted model)"
            if any(k == "PagedAttention" for k in kinds)
            else ""
        )
        raise ConversionError(
            "no ScaledDotProductAttention op found in the model: the pass converts the stateful IR of "
            f"`optimum-cli export openvino` (SDPA attention){hint}"
        )
    if any(p.get_friendly_name() == SEQUENCE_INPUT for p in model.get_parameters()):
        raise ConversionError(f"the model already has a '{SEQUENCE_INPUT}' input: it was converted before")
    return sdpas


@dataclass
class LayerPlan:
    """What replaces one layer's attention: its SDPA, the concats of its K/V state (their new
    token inputs feed the op), the Assigns to drop, its shape and its scale."""

    layer: int
    sdpa: object
    k_concat: object
    v_concat: object
    assigns: list
    shape: AttentionShape
    scale: float

    def inputs(self) -> tuple:
        """The attention's query, and the step's own keys and values (the Concats' new tokens)."""
        return _src(self.sdpa, 0), _src(self.k_concat, 1), _src(self.v_concat, 1)

    def replace_with(self, model, output) -> None:
        """``output`` takes the SDPA's place; the state's Assigns go."""
        self.sdpa.output(0).replace(output)
        for a in self.assigns:
            model.remove_sink(a)


def _plan_layer(layer: int, sdpa, layers: int) -> LayerPlan:
    """Read one layer's attention and state; refuses shapes the op cannot take, naming the layer."""
    q_ps = _src(sdpa, 0).get_partial_shape()
    if q_ps.rank.is_dynamic or q_ps.rank.get_length() != 4:
        raise ConversionError(f"layer {layer}: the query of ScaledDotProductAttention is not 4-D [B, H, L, D]")
    if sdpa.get_input_size() > 5:
        raise ConversionError(
            f"layer {layer}: ScaledDotProductAttention '{sdpa.get_friendly_name()}' takes attention sinks (a sixth "
            "input: a learned logit per head in the softmax, as gpt-oss has), which the op does not compute"
        )
    k_concat, _k_state, k_assigns = _find_state_concat(sdpa, 1, layer)
    v_concat, _v_state, v_assigns = _find_state_concat(sdpa, 2, layer)
    k_ps = _src(k_concat, 1).get_partial_shape()
    v_ps = _src(v_concat, 1).get_partial_shape()
    s = AttentionShape(
        layers=layers,
        q_heads=_static_dim(q_ps, 1, "query heads", layer),
        kv_heads=_static_dim(k_ps, 1, "key heads", layer),
        head_dim=_static_dim(q_ps, 3, "query head size", layer),
    )
    if (
        _static_dim(k_ps, 3, "key head size", layer) != s.head_dim
        or _static_dim(v_ps, 3, "value head size", layer) != s.head_dim
        or _static_dim(v_ps, 1, "value heads", layer) != s.kv_heads
    ):
        raise ConversionError(f"layer {layer}: query/key/value head sizes differ ({q_ps}, {k_ps}, {v_ps})")
    if s.q_heads % s.kv_heads:
        raise ConversionError(f"layer {layer}: {s.q_heads} query heads are not a multiple of {s.kv_heads} KV heads")
    if s.head_dim % 16 or not 16 <= s.head_dim <= 512:
        raise ConversionError(f"layer {layer}: head size {s.head_dim} is not supported (a multiple of 16, 16..512)")
    scale = _scale(sdpa, s.head_dim, layer)
    return LayerPlan(layer, sdpa, k_concat, v_concat, k_assigns + v_assigns, s, scale)


def _replace_attention(model, plans: list[LayerPlan], sequence, library: str | Path, attributes: dict) -> None:
    """Each layer's SDPA becomes our op (query, the step's K and V, the sequence handles) with
    its layer, its scale and the model's ``attributes`` (compute, softcap); its state's Assigns go."""
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(library))
    for plan in plans:
        sdpa = plan.sdpa
        node = factory.create(
            "PagedAttention", [*plan.inputs(), sequence], {"layer": plan.layer, "scale": plan.scale, **attributes}
        )
        node.set_friendly_name(f"{sdpa.get_friendly_name()}/ov_kvcrush_paged")
        plan.replace_with(model, node.output(0))


def _drop_unused_state(model) -> tuple[int, list[str]]:
    """Remove the variables and inputs nothing reads any more (the KV state, ``beam_idx``, ...);
    returns (variables removed, input names removed)."""
    live = _reachable(model)
    live_vars = set()
    for op in model.get_ordered_ops():
        if op.get_type_name() == "ReadValue" and _node_key(op) in live:
            live_vars.add(
                op.get_variable_id() if hasattr(op, "get_variable_id") else op.get_attributes()["variable_id"]
            )
    removed_vars = 0
    for var in list(model.get_variables()):
        if var.get_info().variable_id not in live_vars:
            model.remove_variable(var)
            removed_vars += 1
    removed = []
    for p in list(model.get_parameters()):
        if p.get_friendly_name() == SEQUENCE_INPUT:
            continue
        if not any(_node_key(t.get_node()) in live for t in p.output(0).get_target_inputs()):
            removed.append(p.get_friendly_name())
            model.remove_parameter(p)
    return removed_vars, removed
