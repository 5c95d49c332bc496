"""Replace SDPA + KV state in optimum's stateful IR with our layers for OpenVINO's GPU plugin.

The GPU form of :mod:`~ov_kvcrush.transformations.paged_attention`'s pass: the same layers found
the same way (:func:`~ov_kvcrush.transformations.paged_attention.layer_plans`), but each layer's
attention becomes two of the plugin's ``SimpleGPU`` layers (:mod:`ov_kvcrush.gpu.plugin_layers`):
``OvkcStore`` writes the step's keys and values into the pool, then ``OvkcPrefill`` attends each
token's rows over the slots it sees. A step is one row of tokens (``input_ids [1, T]``) from one
or more sequences side by side, each sequence's tokens adjacent (continuous batching: a prompt's
chunk beside other sequences' decode tokens, as the CPU op's ragged step). The cache's
bookkeeping comes in as inputs the pass adds, one set for every layer (each layer reads its row
with a Gather), with a row per (sequence in the step, KV head), row ``s * kv_heads + kv``:

* ``kvc_pool``: the pool's bytes (uint8), every layer's blocks in one buffer; a remote tensor of
  the plugin's context, written in place by the store layers, kept across inferences;
* ``kvc_tables`` [layers, rows, width]: each row's block ids; ``kvc_first`` and ``kvc_lengths``
  [layers, rows]: its first new slot and its slot count after the step;
* ``kvc_tokens`` [T, 3]: each token's sequence, its index among that sequence's tokens, and
  whether its rows attend the step's own tokens exactly (a prompt's; the prompt layers take the
  model's k and v for them) (:func:`ov_kvcrush.gpu.layer_inputs.token_tensor`);
* ``kvc_step``: :func:`ov_kvcrush.gpu.layer_inputs.step_tensor`;
* ``kvc_score_rows`` [R] (int64, at least one): the step's query rows each layer writes
  (``OvkcRows``, after the prompt layer) into its input ``kvc_rows.<layer>`` (bytes: our buffer, written
  in place, as f32 [q_heads, R, head_dim] whatever the activations), from which the methods'
  scores are computed (:meth:`ov_kvcrush.gpu.layer_cache.DeviceFullLayerCache.after_model_step`).
  An input written in place, not an output: the plugin copies a dynamic output into a buffer of
  ours through the host. Likewise ``kvc_logits.<layer>``: where ``kvc_step`` gives a stride (a
  decode step whose methods score it), each row's logits and log-sum-exp
  (:func:`ov_kvcrush.gpu.layer_inputs.logits_bytes`), the step's probabilities without the keys
  read again; and where it asks for window sums (a prompt's step, whose methods score its last
  rows), ``OvkcRows`` sums each slot's probability over each sequence's score rows into it
  (:class:`ov_kvcrush.gpu.layer_inputs.WindowSums`) from the prompt layer's log-sum-exp.

Over MiniKV's 2-bit store (``quant``: the 2-bit blocks' shape) each layer also quantizes the
full-precision slots a step fills a chunk with (``OvkcFlush``, after the store) and attends the
2-bit slots before the full-precision ones (``OvkcQuantPrefill``), from the inputs
:data:`QUANT_INPUTS` adds, a row per (sequence, KV head) as above:

* ``kvc_qpool``: the 2-bit blocks' bytes, every layer's in one buffer (written in place);
* ``kvc_qtables`` [layers, rows, width]: each row's 2-bit blocks in the store's order after the
  step; ``kvc_qlengths`` [layers, rows]: its 2-bit slots after the step;
* ``kvc_flush`` [layers, rows, 2]: the full-precision slots the step quantizes (first, count:
  whole 2-bit blocks, the last of ``kvc_qtables``'s row).

Under a recalling method (``recall``) each layer recalls for a decode row and lists the slots
it attends (after the rows: ClusterKV's ``OvkcRecall`` ranks the row's centroids by its query;
Quest's ``OvkcPages`` computes the bounds of the pages the step changed and ranks the pages),
then attends a decode row over its list (``OvkcRecallPrefill``), from the inputs
:data:`RECALL_INPUTS` adds:

* ``kvc_index``: int32 words, every layer's and sequence's cluster index or page bounds in one
  buffer (:class:`~ov_kvcrush.gpu.arena.IndexArena`; the pages layer writes its bounds there);
* ``kvc_recall`` [layers, rows, RECALL_WIDTH]: each row's recall
  (:data:`~ov_kvcrush.gpu.layer_inputs.RECALL_FIELDS`, ``PAGE_FIELDS``; token -1 for a row
  that attends its slots in order: a prompt's, a dense layer's);
* ``kvc_recalled.<layer>``: our buffer the recall layer writes each row's list into
  (:func:`~ov_kvcrush.gpu.layer_inputs.recalled_bytes`).

Under Chelsea (``merge``) each layer merges the rows a decode step takes to its budget plus the
merge interval, after the rows and before attending (``OvkcMerge``), then attends every row with
each slot's ``log(degree)`` added to its logit (``OvkcMergePrefill``), from the inputs
:data:`MERGE_INPUTS` adds:

* ``kvc_index``: int32 words, every layer's and sequence's degrees and protect scores in one
  buffer (:class:`~ov_kvcrush.gpu.arena.IndexArena`; the merge layer writes them);
* ``kvc_merge`` [layers, rows, MERGE_WIDTH]: each row's merge
  (:data:`~ov_kvcrush.gpu.chelsea.MERGE_FIELDS`; held 0 for a row that does not merge now);
* ``kvc_scratch.<layer>``: our buffer where the merging rows work (bytes, written in place).

As the CPU pass, the logits come only at the positions ``kvc_logits_at`` names (each sequence's
last token).
"""

from __future__ import annotations

import numpy as np
from ov_kvcrush.transformations.paged_attention import ConvertedModel, finish_conversion, layer_plans

from ov_kvcrush.gpu.chelsea import MERGE_WIDTH
from ov_kvcrush.gpu.layer_inputs import RECALL_WIDTH, STEP_FIELDS, TOKEN_FIELDS
from ov_kvcrush.gpu.layout import PoolShape, QuantShape
from ov_kvcrush.gpu.plugin_layers import KERNELS, LayerAttributes, layer_class

# Imported where used, inside functions: what pulls in openvino, heavy to import, so that importing
# this module stays light.

#: the inputs the pass adds (besides ``kvc_logits_at``): name -> (element type, shape; -1 dynamic,
#: "layers" and "kv_heads" the model's)
PLUGIN_INPUTS = {
    "kvc_pool": (np.uint8, (-1,)),
    "kvc_tables": (np.int32, ("layers", -1, -1)),
    "kvc_first": (np.int32, ("layers", -1)),
    "kvc_lengths": (np.int32, ("layers", -1)),
    "kvc_tokens": (np.int32, (-1, TOKEN_FIELDS)),
    "kvc_step": (np.int32, (len(STEP_FIELDS),)),
    "kvc_score_rows": (np.int64, (-1,)),
}
#: the inputs the pass adds over the 2-bit store, as :data:`PLUGIN_INPUTS`
QUANT_INPUTS = {
    "kvc_qpool": (np.uint8, (-1,)),
    "kvc_qtables": (np.int32, ("layers", -1, -1)),
    "kvc_qlengths": (np.int32, ("layers", -1)),
    "kvc_flush": (np.int32, ("layers", -1, 2)),
}
#: the inputs the pass adds under ClusterKV's recall, as :data:`PLUGIN_INPUTS`
RECALL_INPUTS = {
    "kvc_index": (np.uint8, (-1,)),
    "kvc_recall": (np.int32, ("layers", -1, RECALL_WIDTH)),
}
#: the name of layer ``i``'s recalled slots input (bytes, written in place under ClusterKV)
RECALLED_INPUT = "kvc_recalled.{}"
#: the inputs the pass adds under Chelsea's merge, as :data:`PLUGIN_INPUTS`
MERGE_INPUTS = {
    "kvc_index": (np.uint8, (-1,)),
    "kvc_merge": (np.int32, ("layers", -1, MERGE_WIDTH)),
}
#: the name of layer ``i``'s merge scratch input (bytes, written in place under Chelsea)
SCRATCH_INPUT = "kvc_scratch.{}"
#: the name of layer ``i``'s query rows input (bytes, written in place)
ROWS_INPUT = "kvc_rows.{}"
#: the name of layer ``i``'s logits input (bytes, written in place where ``kvc_step`` asks)
LOGITS_INPUT = "kvc_logits.{}"


def convert_model_for_plugin(
    model,
    *,
    kv_precision: str,
    block_size: int,
    sub_group: int,
    activations: str = "f32",
    quant: QuantShape | None = None,
    recall: str | None = None,
    merge: bool = False,
    last_token_logits: bool = True,
    windows: list[int] | None = None,
    softcap: float = 0.0,
) -> ConvertedModel:
    """Convert ``model`` (an ``openvino.Model`` from optimum's stateful export) in place for the
    GPU plugin, its pool in ``kv_precision`` (f32, f16, u8) blocks of ``block_size`` tokens, its
    kernels at ``sub_group`` lanes, its layers' queries, keys, values and output in
    ``activations`` (the plugin's inference precision: f32 or f16), over the 2-bit store of
    ``quant``'s blocks where given, with a method's recall where ``recall`` names its layer
    (``OvkcRecall``: ClusterKV's; ``OvkcPages``: Quest's), with Chelsea's merge where ``merge``.
    ``windows[i]``: layer ``i``'s sliding window (0 or none given: global), whose layer attends
    that many slots up to each row's own and takes none of the method's layers (the method does
    not run there, as on the CPU op). ``softcap``: the model's attention soft-capping (Gemma 2's;
    0: none). Raises :class:`ConversionError` as the CPU pass does."""
    import openvino.opset13 as ops

    if sum((quant is not None, bool(recall), merge)) > 1:
        raise ValueError("the plugin's layers take one of the 2-bit store, a recall and a merge (quant, recall, merge)")
    plans, shape = layer_plans(model)
    dims = {"layers": shape.layers}
    params = {}
    inputs = PLUGIN_INPUTS | (QUANT_INPUTS if quant is not None else {}) | (RECALL_INPUTS if recall else {})
    inputs |= MERGE_INPUTS if merge else {}
    for name, (kind, dim_names) in inputs.items():
        params[name] = ops.parameter([dims.get(d, d) for d in dim_names], kind, name=name)
        params[name].output(0).get_tensor().set_names({name})
    pool, step, tokens = (params[f"kvc_{name}"].output(0) for name in ("pool", "step", "tokens"))
    score_rows = params["kvc_score_rows"].output(0)
    group = shape.q_heads // shape.kv_heads
    for plan in plans:
        pool_shape = PoolShape(kv_precision, block_size, shape.head_dim, group, softcap)
        window = windows[plan.layer] if windows else 0
        attributes = LayerAttributes(pool_shape, sub_group, plan.scale, activations, quant, window=window)
        attrs, act = attributes.as_dict(), attributes.element_type()
        per_layer = ("tables", "first", "lengths") + (("qtables", "qlengths", "flush") if quant else ())
        per_layer += ("recall",) if recall else ("merge",) if merge else ()
        row = {
            name: ops.gather(params[f"kvc_{name}"], np.array(plan.layer, np.int64), np.array(0, np.int64)).output(0)
            for name in per_layer
        }
        q, k, v = (_squeezed(x, act) for x in plan.inputs())  # [heads, tokens, head_dim]
        stored = layer_class("OvkcStore")([pool, row["tables"], row["first"], tokens, k, v, step], attrs).output(0)
        rows_in, logits = (_bytes_input(params, name.format(plan.layer)) for name in (ROWS_INPUT, LOGITS_INPUT))
        attend = [pool, row["tables"], row["lengths"], row["first"], tokens, q, k, v, step]
        if window:  # a local layer: its window, no method
            out = layer_class("OvkcPrefill")([*attend, stored, logits], attrs).output(0)
        elif recall:
            recalled = _bytes_input(params, RECALLED_INPUT.format(plan.layer))
            args = {"pool": pool, "tables": row["tables"], "index": params["kvc_index"].output(0),
                    "recall": row["recall"], "q": q, "step": step, "stored": stored, "recalled": recalled}  # fmt: skip
            listed = layer_class(recall)([args[name] for name in KERNELS[recall].inputs], attrs).output(0)
            out = layer_class("OvkcRecallPrefill")([*attend, listed, logits, recalled], attrs).output(0)
        elif merge:
            scratch, index = _bytes_input(params, SCRATCH_INPUT.format(plan.layer)), params["kvc_index"].output(0)
            merged = layer_class("OvkcMerge")([pool, row["tables"], index, row["merge"], scratch, step, stored], attrs)
            out = layer_class("OvkcMergePrefill")([*attend, merged.output(0), logits, index], attrs).output(0)
        elif quant is None:
            out = layer_class("OvkcPrefill")([*attend, stored, logits], attrs).output(0)
        else:
            qpool = params["kvc_qpool"].output(0)
            two_bit = [qpool, row["qtables"], row["qlengths"], row["flush"]]
            flushed = layer_class("OvkcFlush")([pool, row["tables"], *two_bit, step, stored], attrs).output(0)
            out = layer_class("OvkcQuantPrefill")([*attend, flushed, *two_bit, logits], attrs).output(0)
        # the rows the methods score, and their window sums where the step asks (the attention passed on)
        scored = [pool, row["tables"], row["lengths"], row["first"], tokens, q, k, step, score_rows, out, logits]
        out = layer_class("OvkcRows")([rows_in, *scored], attrs).output(0)
        back = ops.convert(ops.unsqueeze(out, np.array([0], np.int64)), plan.sdpa.get_output_element_type(0))
        plan.replace_with(model, back.output(0))
    model.add_parameters(list(params.values()))
    return finish_conversion(model, plans, shape, last_token_logits)


def _bytes_input(params: dict, name: str):
    """A per-layer input of bytes (a buffer of ours the layers write in place), added to ``params``."""
    import openvino.opset13 as ops

    params[name] = ops.parameter([-1], np.uint8, name=name)
    params[name].output(0).get_tensor().set_names({name})
    return params[name].output(0)


def _squeezed(x, element_type):
    """``x`` [1, heads, tokens, head_dim] as the layers take it: [heads, tokens, head_dim], in
    ``element_type`` (the activations')."""
    import openvino.opset13 as ops

    squeezed = ops.squeeze(x, np.array([0], np.int64))
    return (ops.convert(squeezed, element_type) if x.get_element_type() != element_type else squeezed).output(0)
