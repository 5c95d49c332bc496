"""The op's KV bytes for a method, measured by running the op itself on random keys and values.

Equal-memory evaluation (``eval --kv-bytes/--kv-ratio``) gives each method the budget at which it
holds a target number of bytes. On backend ``openvino`` those bytes are the op's: its blocks
(full-precision and 2-bit) of the pool's block size and precision, as the engine reports them
after a generation (``SequenceStats.kv_bytes``). What a method holds depends on token counts, not
on values, so :class:`OpProbe` feeds the op, layer by layer in the model's order, a prompt of
random keys/values and the decode steps a generation makes, through one compiled single-op model
per layer, and reads the sequence's bytes: measured, not modelled (a test checks a probe against
the engine's own generation, for every method the op runs).

The probe's pool is ``count_only``: the op stores, selects, merges and quantizes as in a real run
but computes no attention and no scores. A probe of a 32k-token prompt on Gemma 3 took 30 s with
the attention (about 15 probes per method and length); without it, it costs the copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.op import plugin
from ov_kvcrush.op.kvcache import KVPool, infer_steps

# Imported where used, inside functions: what pulls in openvino, heavy to import, so that importing
# this module stays light.


def single_op_model(
    core: Any,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    layer: int = 0,
    scale: float | None = None,
    compute: str = "f32",
    properties: dict[str, Any] | None = None,
    softcap: float = 0.0,
):
    """An inference request of a model that is only our op for ``layer``: inputs ``q``, ``k``, ``v``
    (``[1, heads, tokens, head_dim]`` float32) and ``kvc_sequence``; ``scale`` ``1/sqrt(head_dim)``
    by default; ``softcap`` the op's logit soft-capping (0: none); ``properties``: the CPU
    plugin's compile properties."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(plugin.loaded_path()))
    q = ops.parameter([-1, q_heads, -1, head_dim], np.float32, name="q")
    k = ops.parameter([-1, kv_heads, -1, head_dim], np.float32, name="k")
    v = ops.parameter([-1, kv_heads, -1, head_dim], np.float32, name="v")
    s = ops.parameter([-1], np.int64, name="kvc_sequence")
    node = factory.create(
        "PagedAttention",
        [q.output(0), k.output(0), v.output(0), s.output(0)],
        {
            "layer": layer,
            "scale": scale if scale is not None else 1 / math.sqrt(head_dim),
            "compute": compute,
            "softcap": softcap,
        },
    )
    model = ov.Model([node.output(0)], [q, k, v, s])
    return core.compile_model(model, "CPU", properties or {}).create_infer_request()


class OpProbe:
    """Measures the op's bytes for a model's attention shape and an engine's pools."""

    def __init__(
        self,
        layers: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        new_pool: Callable[..., tuple[Any, int, KVPool]],
    ):
        """``new_pool(compression, count_only=True)`` gives ``(method config, block size, a new
        pool)`` as the engine builds its own (:meth:`OpenVINOEngine.new_pool`)."""

        self.layers, self.q_heads, self.kv_heads, self.head_dim = layers, q_heads, kv_heads, head_dim
        self.new_pool = new_pool
        self.core = plugin.shared_core()
        self._requests: dict[int, Any] = {}

    @classmethod
    def for_engine(cls, engine: Any) -> OpProbe:
        """The probe of an :class:`~ov_kvcrush.serving.openvino_engine.OpenVINOEngine`'s model and pools."""
        s = engine.shape
        return cls(s.layers, s.q_heads, s.kv_heads, s.head_dim, engine.new_pool)

    def _request(self, layer: int) -> Any:
        if layer not in self._requests:
            self._requests[layer] = single_op_model(self.core, self.q_heads, self.kv_heads, self.head_dim, layer)
        return self._requests[layer]

    def held_bytes(self, compression: CompressionConfig, prompt_tokens: int, new_tokens: int, seed: int = 0) -> int:
        """Bytes the op holds after a ``prompt_tokens`` prompt and the ``new_tokens - 1`` decode
        steps of a ``new_tokens`` generation (its last token is never fed back), as the engine."""
        if prompt_tokens < 1 or new_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens}, new_tokens={new_tokens}: allowed >= 1")
        _, _, pool = self.new_pool(compression, count_only=True)
        seq = pool.new_sequence()
        rng = np.random.default_rng(seed)
        try:
            handle = np.array([seq.handle], dtype=np.int64)

            def draw(n: int) -> dict[str, np.ndarray]:
                heads = {"q": self.q_heads, "k": self.kv_heads, "v": self.kv_heads}
                feed = {x: rng.standard_normal((1, h, n, self.head_dim), dtype=np.float32) for x, h in heads.items()}
                return feed | {"kvc_sequence": handle}

            prompt = draw(prompt_tokens)  # one draw for every layer: drawing it per layer cost more than the op
            for layer in range(self.layers):
                infer_steps(self._request(layer), prompt, [seq.handle])
            for _ in range(new_tokens - 1):
                for layer in range(self.layers):
                    infer_steps(self._request(layer), draw(1), [seq.handle])
            return int(seq.stats().kv_bytes)
        finally:
            seq.free()
            pool.close()
