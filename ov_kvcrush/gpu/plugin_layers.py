"""Our op's decode step as layers of OpenVINO's GPU plugin: the ``SimpleGPU`` custom layers of
``device="GPU"`` on the openvino backend, over a pool the plugin holds as a remote tensor.

The plugin runs a custom layer as one OpenCL kernel, given the layer's input tensors and its one
output, with compile-time ``-D`` constants taken from the op's attributes (the ``CONFIG_FILE`` XML
that :func:`write_config` writes). Our decode step is four such layers, each the body of the
pyopencl and SYCL hosts' kernel (``plugins/gpu/kernels/plugin_layers.cl``):

* :class:`OvkcStore` writes the step's keys and values into the pool (an input, written in place:
  a remote tensor of the plugin's context keeps them across inferences);
* :class:`OvkcLogits`, :class:`OvkcSoftmax`, :class:`OvkcValues`: the three passes of paged decode
  attention over each KV head's block table and token count; the softmax's output is the per-head
  probabilities the importance methods accumulate.

What is built here is the layers and a one-layer model of them (:func:`decode_step_model`),
verified on Intel's OpenCL CPU runtime under :mod:`~ov_kvcrush.gpu.emulation`. The graph pass that
puts them in a whole model, and the engine that drives it, are not built yet (docs/intel_gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import quoteattr

import numpy as np

from ov_kvcrush.gpu.device import kernel_dir
from ov_kvcrush.gpu.layout import PRECISIONS, PoolShape
from ov_kvcrush.outputs import write_atomic

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
)
#: the kernels' build options (as the other hosts build them: exact division and square root)
COMPILER_OPTIONS = "-cl-fp32-correctly-rounded-divide-sqrt"


@dataclass(frozen=True)
class LayerKernel:
    """A layer's kernel: its entry, its inputs in argument order, and its work sizes as the
    plugin's rules over the output's dims (``B``: the first, ``F``: the second; ``{sg}``: the
    sub-group size)."""

    entry: str
    guard: str  # the -D that keeps this kernel alone in the source (the plugin wants one a program)
    inputs: tuple[str, ...]
    global_size: str
    local_size: str


KERNELS = {
    "OvkcStore": LayerKernel(
        "ovkc_store", "OVKC_LAYER_STORE", ("pool", "tables", "first", "k", "v", "step"), "{sg},F,B", "{sg},1,1"
    ),
    "OvkcLogits": LayerKernel(
        "ovkc_logits", "OVKC_LAYER_LOGITS", ("pool", "tables", "lengths", "q", "step", "stored"), "F,B", "{sg},1"
    ),
    "OvkcSoftmax": LayerKernel("ovkc_softmax", "OVKC_LAYER_SOFTMAX", ("logits", "lengths", "step"), "{sg},B", "{sg},1"),
    "OvkcValues": LayerKernel(
        "ovkc_values", "OVKC_LAYER_VALUES", ("pool", "tables", "lengths", "probs", "step"), "F,B", "{sg},1"
    ),
}


@dataclass(frozen=True)
class LayerAttributes:
    """What the four layers are compiled for (their ``-D`` constants)."""

    shape: PoolShape
    sub_group: int
    scale: float

    def as_dict(self) -> dict[str, object]:
        return {
            "sub_group": self.sub_group,
            "kv_precision": PRECISIONS.index(self.shape.precision),
            "block_size": self.shape.block_size,
            "head_dim": self.shape.head_dim,
            "group": self.shape.group,
            "scale": f"{self.scale:.9g}",  # a string: the plugin prints a float attribute to 6 places
        }


def _layer_classes() -> dict[str, type]:
    """The four op classes (``openvino.Op`` subclasses, made when first needed: ``openvino`` is
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

    return {cls.__name__: cls for cls in (OvkcStore, OvkcLogits, OvkcSoftmax, OvkcValues)}


_CLASSES: dict[str, type] = {}


def layer_class(name: str) -> type:
    """The op class of layer ``name`` (one of :data:`KERNELS`)."""
    if not _CLASSES:
        _CLASSES.update(_layer_classes())
    return _CLASSES[name]


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
    sg = str(attributes.sub_group)
    parts = []
    for name, kernel in KERNELS.items():
        defines = "\n".join(
            f'    <Define name="{define}" param="{attr}" type="{"float" if attr == "scale" else "int"}" '
            f"default={quoteattr(str(values[attr]))}/>"
            for define, attr in DEFINES
        )
        defines += f'\n    <Define name="{kernel.guard}" param="{kernel.guard.lower()}" type="int" default="1"/>'
        count = len(kernel.inputs)
        tensors = [f'    <Tensor arg-index="{i}" type="input" port-index="{i}" format="BFYX"/>' for i in range(count)]
        tensors.append(f'    <Tensor arg-index="{count}" type="output" port-index="0" format="BFYX"/>')
        parts.append(
            f'<CustomLayer name="{name}" type="SimpleGPU" version="1">\n'
            f'  <Kernel entry="{kernel.entry}">\n    <Source filename="{source_name}"/>\n{defines}\n  </Kernel>\n'
            "  <Buffers>\n" + "\n".join(tensors) + "\n  </Buffers>\n"
            f'  <CompilerOptions options="{COMPILER_OPTIONS}"/>\n'
            f'  <WorkSizes global="{kernel.global_size.format(sg=sg)}" local="{kernel.local_size.format(sg=sg)}" '
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


def decode_step_model(attributes: LayerAttributes, q_heads: int, kv_heads: int) -> object:
    """One layer's decode step as a model of the four layers. Inputs: ``q`` [q_heads, D], ``k``
    and ``v`` [kv_heads, tokens, D] (the step's), ``pool`` (uint8 bytes, written in place),
    ``tables`` [kv_heads, width] (block ids), ``first`` [kv_heads] (each head's first new slot),
    ``lengths`` [kv_heads] (its slots after the step), ``step`` [1] (``width``). Outputs: the
    attention [q_heads, D] and the probabilities [q_heads, width * block_size]."""
    import openvino as ov
    from openvino import opset13 as ops

    d = attributes.shape.head_dim
    params = {
        # dynamic query heads: the plugin gives a static custom layer a 4-D output its Result refuses
        "q": ops.parameter([-1, d], np.float32, name="q"),
        "k": ops.parameter([kv_heads, -1, d], np.float32, name="k"),
        "v": ops.parameter([kv_heads, -1, d], np.float32, name="v"),
        "pool": ops.parameter([-1], np.uint8, name="pool"),
        "tables": ops.parameter([kv_heads, -1], np.int32, name="tables"),
        "first": ops.parameter([kv_heads], np.int32, name="first"),
        "lengths": ops.parameter([kv_heads], np.int32, name="lengths"),
        "step": ops.parameter([1], np.int32, name="step"),
    }
    attrs = attributes.as_dict()
    values = {name: p.output(0) for name, p in params.items()}

    def layer(name: str) -> object:
        node = layer_class(name)([values[i] for i in KERNELS[name].inputs], attrs)
        return node.output(0)

    values["stored"] = layer("OvkcStore")
    values["logits"] = layer("OvkcLogits")
    values["probs"] = layer("OvkcSoftmax")
    out = layer("OvkcValues")
    return ov.Model([out, values["probs"]], list(params.values()), "ovkc_decode_step")


@dataclass
class DecodeScenario:
    """A pool laid out as the CPU op's (each KV head its own tokens, shuffled blocks with garbage
    between them) and decode steps over it, each storing one token per KV head."""

    attributes: LayerAttributes
    q_heads: int
    pool: np.ndarray
    steps: list[dict[str, np.ndarray]]
    #: per step, each KV head's keys and values after it (what its attention reads, as given)
    keys: list[list[np.ndarray]]
    values: list[list[np.ndarray]]


def random_scenario(attributes: LayerAttributes, kv_heads: int, tokens: tuple[int, ...], steps: int,
                    rng: np.random.Generator) -> DecodeScenario:  # fmt: skip
    """``steps`` decode steps after ``tokens[h]`` tokens of KV head ``h``, from ``rng``."""
    from ov_kvcrush.gpu.layout import page_heads

    shape, d = attributes.shape, attributes.shape.head_dim
    q_heads = kv_heads * shape.group
    keys = [rng.standard_normal((n, d)).astype(np.float32) for n in tokens]
    values = [rng.standard_normal((n, d)).astype(np.float32) for n in tokens]
    heads = page_heads(shape, keys, values, rng)
    width = np.array([heads.tables.shape[1]], np.int32)
    scenario = DecodeScenario(attributes, q_heads, heads.pool, [], [], [])
    for _ in range(steps):
        q = rng.standard_normal((q_heads, d)).astype(np.float32)
        k = rng.standard_normal((kv_heads, 1, d)).astype(np.float32)
        v = rng.standard_normal((kv_heads, 1, d)).astype(np.float32)
        first = np.array([len(x) for x in keys], np.int32)
        keys = [np.concatenate([keys[i], k[i]]) for i in range(kv_heads)]
        values = [np.concatenate([values[i], v[i]]) for i in range(kv_heads)]
        feeds = {"q": q, "k": k, "v": v, "tables": heads.tables, "first": first, "lengths": first + 1}
        scenario.steps.append({**feeds, "step": width})
        scenario.keys.append(keys)
        scenario.values.append(values)
    return scenario


def run_on_plugin(core: object, folder: Path, scenario: DecodeScenario) -> list[tuple[np.ndarray, np.ndarray]]:
    """Compile the decode-step model on ``core``'s ``GPU`` (the layers' ``CONFIG_FILE`` written
    into ``folder``), hold the scenario's pool in a remote tensor of the plugin's context and run
    its steps; each step's (attention, probabilities)."""
    import openvino as ov

    config = write_config(folder, scenario.attributes)
    core.set_property("GPU", {"CONFIG_FILE": str(config)})  # type: ignore[attr-defined]
    kv_heads = len(scenario.keys[0]) if scenario.keys else 1
    model = decode_step_model(scenario.attributes, scenario.q_heads, kv_heads)
    compiled = core.compile_model(model, "GPU", {"INFERENCE_PRECISION_HINT": "f32"})  # type: ignore[attr-defined]
    request = compiled.create_infer_request()
    context = core.get_default_context("GPU")  # type: ignore[attr-defined]
    pool = context.create_tensor(ov.Type.u8, ov.Shape([scenario.pool.size]), {})
    pool.copy_from(ov.Tensor(scenario.pool))
    request.set_tensor("pool", pool)
    results = []
    for feeds in scenario.steps:
        for name, array in feeds.items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.infer()
        results.append((request.get_output_tensor(0).data.copy(), request.get_output_tensor(1).data.copy()))
    return results
