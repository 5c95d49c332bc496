"""Our op's decode step as layers of OpenVINO's GPU plugin: the ``SimpleGPU`` custom layers of
``device="GPU"`` on the openvino backend, over a pool the plugin holds as a remote tensor.

The plugin runs a custom layer as one OpenCL kernel, given the layer's input tensors and its one
output, with compile-time ``-D`` constants taken from the op's attributes (the ``CONFIG_FILE`` XML
that :func:`write_config` writes). Our steps are such layers, each the body of the
pyopencl and SYCL hosts' kernel (``plugins/gpu/kernels/plugin_layers.cl``):

* :class:`OvkcStore` writes the step's keys and values into the pool (an input, written in place:
  a remote tensor of the plugin's context keeps them across inferences);
* :class:`OvkcLogits`, :class:`OvkcSoftmax`, :class:`OvkcValues`: the three passes of paged decode
  attention over each KV head's block table and token count; the softmax's output is the per-head
  probabilities the importance methods accumulate;
* :class:`OvkcRows`: after the prompt layer, the step's query rows the methods score, written
  into our buffer (an input, written in place: a model output would come back to it through the
  host), and where the step asks (:class:`~ov_kvcrush.gpu.layer_inputs.WindowSums`) each slot's
  probability summed over its sequence's score rows (a prompt's window: SnapKV's, H2O's every
  row; KVzip's largest instead)
  into ``logits``, from the model's own attention: the rows' log-sum-exp the prompt layer wrote,
  the step's own keys as the model gave them (no host launch reads the keys again for a
  prompt's scores);
* :class:`OvkcPrefill`: a step's query rows over the slots each sees (a prompt's chunk row by
  row, the sub-group's lanes rows side by side; a decode token all its sequence holds, and in a
  step of decode tokens alone :data:`DECODE_PARTS` sub-groups a row, each over a partition of its
  slots split across its lanes, merged by :class:`OvkcRows`),
  several sequences side by side (``tokens``: each
  token's sequence and index in it; the cache's tensors a row per sequence and KV head); where
  asked, each row's logits and log-sum-exp into our buffer (``logits``, written in place), from
  which the scoring methods take a decode step's probabilities;
* over MiniKV's 2-bit store (a second pool of 2-bit blocks, :class:`~ov_kvcrush.gpu.layout.QuantShape`),
  :class:`OvkcFlush` quantizes the full-precision slots the step fills a chunk with (the step's own
  token among them, as the reference flushes before attending) and :class:`OvkcQuantPrefill`
  attends each row over its 2-bit slots, then its full-precision ones, under one softmax;
* under ClusterKV, :class:`OvkcRecall` ranks each decode row's centroids by its query, recalls
  whole clusters up to the budget and lists the slots the row attends (the sinks, the recalled,
  the pending) into our buffer (``recalled``, written in place), over the cluster index in
  ``index`` (our buffer: every layer's and sequence's, :class:`~ov_kvcrush.gpu.arena.IndexArena`);
  under Quest, :class:`OvkcPages` computes the bounds of the pages the step changed (into
  ``index``), ranks the pages by the query's upper bound and lists the slots of the top ones;
  :class:`OvkcRecallPrefill` attends a decode row over its list, the other rows as
  :class:`OvkcPrefill`;
* under Chelsea, :class:`OvkcMerge` merges the rows a decode step takes to the budget plus the
  merge interval (:mod:`~ov_kvcrush.gpu.chelsea`: in place, their degrees and scores in ``index``),
  after the store and before :class:`OvkcMergePrefill` attends, which adds each slot's
  ``log(degree)`` to its logit.

What a step feeds them besides the model's tensors (the ``step`` tensor, each token's row, the
recall fields, the layout of our buffers they write) is :mod:`~ov_kvcrush.gpu.layer_inputs`'s.

Here are the layers (one-layer models of them, :mod:`~ov_kvcrush.gpu.plugin_step_models`, are
verified on Intel's OpenCL CPU runtime under
:mod:`~ov_kvcrush.gpu.emulation`; ``transformations/plugin_attention.py`` puts the store and
prompt layers in a whole model, which :mod:`~ov_kvcrush.engines.gpu_plugin_model` runs (the
openvino engine's ``device="GPU"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from xml.sax.saxutils import quoteattr

from ov_kvcrush.gpu.device import compiler_options, kernel_dir
from ov_kvcrush.gpu.layout import PRECISIONS, PoolShape, QuantShape
from ov_kvcrush.outputs import write_atomic

# Imported where used, inside functions: what pulls in openvino, heavy to import, so that importing
# this module stays light.

#: the file of the layers' kernels, its includes inlined (the plugin compiles one source text)
SOURCE = "plugin_layers.cl"
#: the attributes every layer carries, as the kernels' -D constants: (define, attribute)
DEFINES = (
    ("SG", "sub_group"),
    ("KV_PRECISION", "kv_precision"),
    ("BLOCK_SIZE", "block_size"),
    ("HEAD_DIM", "head_dim"),
    ("GROUP", "group"),
    ("SCALE", "scale"),
    ("ACT_HALF", "act_half"),
    ("WINDOW", "window"),
    ("SOFTCAP", "softcap"),
    ("PARTS", "parts"),
)
#: the attributes that are floats (printed as strings: the plugin prints a float to 6 places)
FLOAT_ATTRIBUTES = ("scale", "softcap")
#: what the 2-bit store's layers carry besides (:class:`~ov_kvcrush.gpu.layout.QuantShape`'s)
QUANT_DEFINES = (
    ("QUANT_TOKENS", "quant_tokens"),
    ("QGROUP", "qgroup"),
    ("KEY_BITS", "key_bits"),
    ("VALUE_BITS", "value_bits"),
)
#: the quant defines' values in a config whose model has no 2-bit store (no layer uses them)
QUANT_DEFAULTS = {"quant_tokens": 32, "qgroup": 16, "key_bits": 2, "value_bits": 2}
#: the partitions a decode row's slots are split into, a sub-group each, in a step of decode rows
#: alone (the prompt layers' work size: their rows times the sub-group times this), merged after
#: by the rows layer (native's decode: one long sequence keeps the whole GPU busy)
DECODE_PARTS = 8
#: the activation types the store and prompt layers take and return: the plugin's inference
#: precision (``INFERENCE_PRECISION_HINT``; its default on Intel GPUs is f16)
ACTIVATIONS = ("f32", "f16")


@dataclass(frozen=True)
class LayerKernel:
    """A layer's kernel: its entry, its inputs in argument order, and its work sizes as the
    plugin's rules over the output's dims (``B``: the first, ``F``: the second; ``{sg}``: the
    sub-group size; ``{parts}``: a decode row's partitions)."""

    entry: str
    guard: str  # the -D that keeps this kernel alone in the source (the plugin wants one a program)
    inputs: tuple[str, ...]
    global_size: str
    local_size: str
    quant: bool = False  # a layer of the 2-bit store (QUANT_DEFINES too)


KERNELS = {
    "OvkcStore": LayerKernel(
        "ovkc_store",
        "OVKC_LAYER_STORE",
        ("pool", "tables", "first", "tokens", "k", "v", "step"),
        "{sg},F,B",
        "{sg},1,1",
    ),
    "OvkcLogits": LayerKernel(
        "ovkc_logits", "OVKC_LAYER_LOGITS", ("pool", "tables", "lengths", "q", "step", "stored"), "F,B", "{sg},1"
    ),
    "OvkcSoftmax": LayerKernel("ovkc_softmax", "OVKC_LAYER_SOFTMAX", ("logits", "lengths", "step"), "{sg},B", "{sg},1"),
    "OvkcValues": LayerKernel(
        "ovkc_values", "OVKC_LAYER_VALUES", ("pool", "tables", "lengths", "probs", "step"), "F,B", "{sg},1"
    ),
    "OvkcRows": LayerKernel(
        "ovkc_rows",
        "OVKC_LAYER_ROWS",
        ("rows", "pool", "tables", "lengths", "first", "tokens", "q", "k", "step", "score_rows", "attended", "logits"),
        "F*{sg},B",
        "{sg},1",
    ),
    "OvkcPrefill": LayerKernel(
        "ovkc_prefill",
        "OVKC_LAYER_PREFILL",
        ("pool", "tables", "lengths", "first", "tokens", "q", "k", "v", "step", "stored", "logits"),
        "F*{sg}*{parts},B",
        "{sg},1",
    ),
    "OvkcFlush": LayerKernel(
        "ovkc_flush",
        "OVKC_LAYER_FLUSH",
        ("pool", "tables", "qpool", "qtables", "qlengths", "flush", "step", "stored"),
        "F,B",
        "1,1",
        quant=True,
    ),
    "OvkcQuantPrefill": LayerKernel(
        "ovkc_quant_prefill",
        "OVKC_LAYER_QPREFILL",
        (
            "pool",
            "tables",
            "lengths",
            "first",
            "tokens",
            "q",
            "k",
            "v",
            "step",
            "stored",
            "qpool",
            "qtables",
            "qlengths",
            "flush",
            "logits",
        ),
        "F*{sg}*{parts},B",
        "{sg},1",
        quant=True,
    ),
    "OvkcRecall": LayerKernel(
        "ovkc_recall",
        "OVKC_LAYER_RECALL",
        ("index", "recall", "q", "step", "stored", "recalled"),
        "{sg},B",
        "{sg},1",
    ),
    "OvkcPages": LayerKernel(
        "ovkc_pages",
        "OVKC_LAYER_PAGES",
        ("pool", "tables", "index", "recall", "q", "step", "stored", "recalled"),
        "{sg},B",
        "{sg},1",
    ),
    "OvkcMerge": LayerKernel(
        "ovkc_merge",
        "OVKC_LAYER_MERGE",
        ("pool", "tables", "index", "merge", "scratch", "step", "stored"),
        "{sg},B",
        "{sg},1",
    ),
    "OvkcMergePrefill": LayerKernel(
        "ovkc_merge_prefill",
        "OVKC_LAYER_MPREFILL",
        ("pool", "tables", "lengths", "first", "tokens", "q", "k", "v", "step", "stored", "logits", "index"),
        "F*{sg}*{parts},B",
        "{sg},1",
    ),
    "OvkcRecallPrefill": LayerKernel(
        "ovkc_recall_prefill",
        "OVKC_LAYER_RPREFILL",
        ("pool", "tables", "lengths", "first", "tokens", "q", "k", "v", "step", "stored", "logits", "recalled"),
        "F*{sg}*{parts},B",
        "{sg},1",
    ),
}


@dataclass(frozen=True)
class LayerAttributes:
    """What the layers are compiled for (their ``-D`` constants)."""

    shape: PoolShape
    sub_group: int
    scale: float
    activations: str = "f32"  # one of ACTIVATIONS
    quant: QuantShape | None = None  # the 2-bit store's blocks, where the model has one
    #: the pool may pass the device's largest allocation (``Device.large_buffers``): the layers
    #: are built with the option that lets a kernel read such a buffer
    large_buffers: bool = False
    #: a sliding-window layer's span (a row sees that many slots up to its own; 0: a global layer)
    window: int = 0
    #: the partitions of a decode row (:data:`DECODE_PARTS`)
    parts: int = DECODE_PARTS

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: one of {', '.join(ACTIVATIONS)}")

    def as_dict(self) -> dict[str, object]:
        return {
            "sub_group": self.sub_group,
            "kv_precision": PRECISIONS.index(self.shape.precision),
            "block_size": self.shape.block_size,
            "head_dim": self.shape.head_dim,
            "group": self.shape.group,
            "scale": f"{self.scale:.9g}",  # a string: the plugin prints a float attribute to 6 places
            "act_half": int(self.activations == "f16"),
            "window": self.window,
            "softcap": f"{self.shape.softcap:.9g}",
            "parts": self.parts,
        } | self.quant_values()

    def quant_values(self) -> dict[str, int]:
        """The 2-bit store's attributes (:data:`QUANT_DEFINES`; their defaults without one)."""
        q = self.quant
        if q is None:
            return dict(QUANT_DEFAULTS)
        return {"quant_tokens": q.block_size, "qgroup": q.qgroup, "key_bits": q.key_bits, "value_bits": q.value_bits}

    def element_type(self) -> object:
        """The activations' ``openvino.Type``."""
        import openvino as ov

        return ov.Type.f16 if self.activations == "f16" else ov.Type.f32


@cache
def _layer_classes() -> dict[str, type]:
    """The layers' op classes (``openvino.Op`` subclasses, made when first needed: ``openvino`` is
    imported here, not when :mod:`ov_kvcrush.gpu` is)."""
    import openvino as ov

    class PluginLayer(ov.Op):
        """One of our layers: inputs in :data:`KERNELS` order, one output, the attributes."""

        def __init__(self, inputs: list | None = None, attributes: dict | None = None) -> None:
            super().__init__(self)
            self._attributes = dict(attributes or {})
            if inputs is not None:  # the attributes first: shape inference reads them
                self.set_arguments(inputs)
                self.constructor_validate_and_infer_types()

        def clone_with_new_inputs(self, new_inputs: list) -> PluginLayer:
            return type(self)(new_inputs, self._attributes)

        def visit_attributes(self, visitor: object) -> bool:
            visitor.on_attributes(self._attributes)  # type: ignore[attr-defined]
            return True

        def input_shape(self, name: str) -> object:
            return self.get_input_partial_shape(KERNELS[type(self).__name__].inputs.index(name))

        def input_type(self, name: str) -> object:
            return self.get_input_element_type(KERNELS[type(self).__name__].inputs.index(name))

    class OvkcStore(PluginLayer):
        def validate_and_infer_types(self) -> None:
            k = self.input_shape("k")  # [kv_heads, tokens, head_dim]
            self.set_output_type(0, ov.Type.i32, ov.PartialShape([k[0], k[1]]))

    class OvkcLogits(PluginLayer):
        def validate_and_infer_types(self) -> None:
            q, tables = self.input_shape("q"), self.input_shape("tables")
            width = tables[1]
            slots = width.get_length() * self._attributes["block_size"] if width.is_static else -1
            self.set_output_type(0, ov.Type.f32, ov.PartialShape([q[0], slots]))

    class OvkcSoftmax(PluginLayer):
        def validate_and_infer_types(self) -> None:
            self.set_output_type(0, ov.Type.f32, self.input_shape("logits"))

    class OvkcValues(PluginLayer):
        def validate_and_infer_types(self) -> None:
            probs = self.input_shape("probs")
            self.set_output_type(0, ov.Type.f32, ov.PartialShape([probs[0], self._attributes["head_dim"]]))

    class OvkcRows(PluginLayer):
        def validate_and_infer_types(self) -> None:  # the prompt layer's output passed on
            self.set_output_type(0, self.input_type("attended"), self.input_shape("attended"))

    class OvkcPrefill(PluginLayer):
        def validate_and_infer_types(self) -> None:
            q = self.input_shape("q")  # [q_heads, rows, head_dim], in the activations' type
            dims = ov.PartialShape([q[0], q[1], self._attributes["head_dim"]])
            self.set_output_type(0, ov.Type.f16 if self._attributes.get("act_half") else ov.Type.f32, dims)

    class OvkcRecall(PluginLayer):
        rows_input = "recall"  # the rows' input passed on as the output: [rows, RECALL_WIDTH]

        def validate_and_infer_types(self) -> None:
            self.set_output_type(0, ov.Type.i32, self.input_shape(self.rows_input))

    class OvkcMerge(OvkcRecall):
        rows_input = "merge"  # [rows, MERGE_WIDTH]

    class OvkcFlush(PluginLayer):
        def validate_and_infer_types(self) -> None:
            rows = self.input_shape("flush")[0]  # [rows, 2]
            self.set_output_type(0, ov.Type.i32, ov.PartialShape([rows, self._attributes["quant_tokens"]]))

    # the prompt layers over the 2-bit store, a recall's list and a merge's degrees: the prompt layer's
    # shapes, and the recall layers': the rows passed on
    alike = {name: type(name, (base,), {}) for base, names in ((OvkcPrefill, ("OvkcQuantPrefill", "OvkcRecallPrefill",
             "OvkcMergePrefill")), (OvkcRecall, ("OvkcPages",))) for name in names}  # fmt: skip
    classes = (OvkcStore, OvkcLogits, OvkcSoftmax, OvkcValues, OvkcRows, OvkcPrefill, OvkcFlush, OvkcRecall, OvkcMerge)
    return {cls.__name__: cls for cls in classes} | alike


def layer_class(name: str) -> type:
    """The op class of layer ``name`` (one of :data:`KERNELS`)."""
    return _layer_classes()[name]


def kernel_source() -> str:
    """``plugin_layers.cl`` with its includes inlined, each file once (the plugin compiles one text
    and gives it no include path)."""
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        lines = []
        for line in (kernel_dir() / name).read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("#include "):
                lines.append(inline(stripped.split('"')[1]))
            else:
                lines.append(line)
        return "\n".join(lines)

    return inline(SOURCE) + "\n"


def config_xml(attributes: LayerAttributes, source_name: str) -> str:
    """The ``CONFIG_FILE`` text: one ``CustomLayer`` per layer, the kernels in ``source_name``
    beside it, each define's default the value of ``attributes``."""
    values = attributes.as_dict()
    sg, partitions = str(attributes.sub_group), str(attributes.parts)
    options = " ".join(compiler_options(attributes.large_buffers))  # as the other hosts build them
    parts = []
    for name, kernel in KERNELS.items():
        defines = "\n".join(
            f'    <Define name="{define}" param="{attr}" type="{"float" if attr in FLOAT_ATTRIBUTES else "int"}" '
            f"default={quoteattr(str(values[attr]))}/>"
            for define, attr in DEFINES + (QUANT_DEFINES if kernel.quant else ())
        )
        defines += f'\n    <Define name="{kernel.guard}" param="{kernel.guard.lower()}" type="int" default="1"/>'
        count = len(kernel.inputs)
        tensors = [f'    <Tensor arg-index="{i}" type="input" port-index="{i}" format="BFYX"/>' for i in range(count)]
        tensors.append(f'    <Tensor arg-index="{count}" type="output" port-index="0" format="BFYX"/>')
        parts.append(
            f'<CustomLayer name="{name}" type="SimpleGPU" version="1">\n'
            f'  <Kernel entry="{kernel.entry}">\n    <Source filename="{source_name}"/>\n{defines}\n  </Kernel>\n'
            "  <Buffers>\n" + "\n".join(tensors) + "\n  </Buffers>\n"
            f'  <CompilerOptions options="{options}"/>\n'
            f'  <WorkSizes global="{kernel.global_size.format(sg=sg, parts=partitions)}" '
            f'local="{kernel.local_size.format(sg=sg)}" '
            'dim="output"/>\n'
            "</CustomLayer>\n"
        )
    return "".join(parts)


def write_config(folder: Path, attributes: LayerAttributes) -> Path:
    """Write the layers' kernel source and ``CONFIG_FILE`` into ``folder`` (each whole or not at
    all); returns the XML's path, for ``core.set_property("GPU", {"CONFIG_FILE": path})``."""
    folder.mkdir(parents=True, exist_ok=True)
    source = write_atomic(folder / "ovkc_plugin_layers.cl", lambda p: p.write_text(kernel_source()))
    return write_atomic(folder / "ovkc_plugin_layers.xml", lambda p: p.write_text(config_xml(attributes, source.name)))
