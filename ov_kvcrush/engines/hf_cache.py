"""transformers integration: a ``Cache`` that holds each layer's compressed state, and the attention over it.

How a forward pass flows through it (transformers 5 attention modules do, per layer: project,
apply RoPE, ``past_key_values.update(k, v, layer_idx)``, then the registered attention function):

1. :meth:`CompressedCache.update` receives the step's new keys/values (after RoPE) and parks them;
   it returns them unchanged, so nothing full-size is ever built.
2. :func:`compressed_attention` (registered as ``attn_implementation="ov_kvcrush"``) takes the
   parked keys/values and the **current** queries and hands them to the layer's
   :class:`~ov_kvcrush.methods.LayerCache`: ``prefill`` for the prompt, ``decode`` afterwards.
   The method appends, evicts, merges, quantizes or recalls, and computes attention over exactly
   what it holds (with the per-head scores, Chelsea's ``log(degree)`` bias, the 2-bit
   dequantisation ... all inside the method).

Keys are stored after RoPE at their original positions (as in H2O, SnapKV, KVCrush, ClusterKV), so
a kept token never needs re-rotation; new tokens take positions from ``get_seq_length()``, the
number of tokens *seen*, not held.

The cache and the attention function meet through a thread-local set by ``update``: the
attention call follows its layer's ``update`` in the same thread, so a plain
``model.generate(..., past_key_values=CompressedCache(...))`` works without extra arguments.

Sliding-window layers of hybrid models (Gemma 3's local layers) get a
:class:`~ov_kvcrush.methods.full.SlidingWindowLayerCache`: the model already bounds them, and the
method (with its per-layer budgets, pyramids, dense layers) is laid over the global layers only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ov_kvcrush.errors import UserError
from ov_kvcrush.fastpath import fast_layer
from ov_kvcrush.fastpath.dense import FastLayerCache
from ov_kvcrush.methods import LayerCache, MethodConfig
from ov_kvcrush.methods.base import PromptMemo, storage_bytes
from ov_kvcrush.methods.full import SlidingWindowLayerCache

#: Name to pass as ``attn_implementation`` when loading a model.
ATTN_IMPLEMENTATION = "ov_kvcrush"

_CURRENT = threading.local()


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's slot in :class:`CompressedCache`: a method's :class:`LayerCache` plus the
    keys/values parked between ``update`` and the attention call."""

    is_compileable = False
    is_croppable = False

    def __init__(self, method: LayerCache, sliding: bool = False) -> None:
        super().__init__()
        self.method = method
        self.is_sliding = sliding
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        #: the same layer of other caches that take this prompt too (see
        #: :meth:`CompressedCache.share_prefill`); emptied once the prompt has been attended.
        self.followers: list[CompressedLayer] = []
        #: ms of the method's own work (its calls' time less their attention), CPU only
        self.policy_ms = {"prefill": 0.0, "decode": 0.0}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                "the previous keys/values of this layer were never attended: load the model with "
                f"attn_implementation={ATTN_IMPLEMENTATION!r} (see ov_kvcrush.engines.hf_cache.load_model)"
            )
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.method.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen so far (the next position), not tokens held: positions never shift."""
        return self.method.seen

    def get_max_length(self) -> int:
        """No fixed maximum (-1, as a dynamic layer answers); the name newer transformers (5.17+) use."""
        return -1

    def get_max_cache_shape(self) -> int:
        """The same, under the name of older transformers (5.5)."""
        return -1

    def reset(self) -> None:
        raise UserError("a compressed cache cannot be reset in place; create a new CompressedCache per sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UserError("beam search is not supported with a compressed KV cache (use greedy or sampling)")

    def crop(self, max_length: int) -> None:
        raise UserError("a compressed KV cache cannot be cropped (assisted/speculative decoding is not supported)")

    def offload(self) -> None:
        raise UserError("cache offloading is not supported with a compressed KV cache")

    def prefetch(self) -> None:
        return None


@dataclass(frozen=True)
class ModelShape:
    """What the KV memory of a model depends on: the engine's full-cache bytes and the
    evaluation's equal-memory probes (:mod:`ov_kvcrush.eval.budget`) read the same numbers."""

    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype) -> ModelShape:
        """From a transformers config and the dtype the engine stores keys/values in."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = int(text.num_hidden_layers)
        types = tuple(getattr(text, "layer_types", None) or ["full_attention"] * n)
        return cls(
            num_layers=n,
            q_heads=int(text.num_attention_heads),
            kv_heads=int(text.num_key_value_heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
            element_bytes=torch.empty((), dtype=dtype).element_size(),
            layer_types=types,
            sliding_window=getattr(text, "sliding_window", None),
        )

    def full_kv_bytes(self, tokens: int) -> int:
        """Bytes of an uncompressed cache holding ``tokens`` tokens (sliding layers capped at their window)."""
        total = 0
        for kind in self.layer_types:
            n = min(tokens, self.sliding_window) if kind == "sliding_attention" and self.sliding_window else tokens
            total += 2 * self.kv_heads * n * self.head_dim * self.element_bytes
        return total

    def model_config(self) -> SimpleNamespace:
        """A stand-in for the model's config, enough to build its caches (``CompressedCache``)."""
        return SimpleNamespace(
            num_hidden_layers=self.num_layers, layer_types=list(self.layer_types), sliding_window=self.sliding_window
        )


class CompressedCache(Cache):
    """A transformers ``Cache`` whose layers hold a KV-cache method's compressed state.

    Args:
        method: the method's reference config (``CompressionConfig.method_config()``).
        model_config: the model's config (``model.config``); gives the layer count and which
            layers are sliding-window layers.
        fast_path: use the method's fast layer cache where it has one
            (:func:`ov_kvcrush.fastpath.fast_layer`: same results, no host work per step; the
            torch engine turns it on for CUDA), the reference elsewhere.
        reserve: tokens the cache will receive after the prompt (fast layers preallocate them).
        layer_source: builds each global layer's cache instead (``(method, layer, layers)``; the
            GPU path's device layers, :func:`ov_kvcrush.gpu.layer_cache.device_layer`).
    """

    def __init__(
        self,
        method: MethodConfig,
        model_config: Any,
        fast_path: bool = False,
        reserve: int = 0,
        layer_source: Callable[[MethodConfig, int, int], LayerCache] | None = None,
    ) -> None:
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        n = int(text.num_hidden_layers)
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
        sliding = [t == "sliding_attention" for t in types]
        if all(sliding):
            sliding = [False] * n  # nothing global: the method runs everywhere (window checked per step)
        global_layers = [i for i in range(n) if not sliding[i]]
        layers: list[CompressedLayer] = []
        for i in range(n):
            if sliding[i]:
                layers.append(CompressedLayer(SlidingWindowLayerCache(int(text.sliding_window)), sliding=True))
            else:
                g, total = global_layers.index(i), len(global_layers)
                if layer_source is not None:
                    layers.append(CompressedLayer(layer_source(method, g, total)))
                    continue
                fast = fast_layer(method, g, total, reserve) if fast_path else None
                layers.append(CompressedLayer(fast or method.make_layer(g, total)))
        super().__init__(layers=layers)
        self.method_config = method
        #: while True, each attention call is a step of the method's scoring pass
        #: (:meth:`run_scoring_pass`): it scores what is held and keeps nothing of the step
        self.scoring = False
        #: the positions the current scoring step scores, ``[lo, hi)``
        self.scoring_range = (0, 0)

    def run_scoring_pass(
        self,
        context: list[int],
        start: int,
        encode: Callable[[str], list[int]],
        prefix: list[int],
        forward: Callable[[list[int]], object],
    ) -> bool:
        """The method's scoring pass over ``context`` (the ids not scored yet, from position
        ``start``), when it has one and the cache is over its budget: each step's ids go through
        ``forward`` (one model call with this cache), then the method selects. Returns whether a
        pass ran."""
        method = self.method_config
        layers = [layer.method for layer in self.layers if not layer.is_sliding]
        if not method.scoring_pass or not layers or not layers[0].seen:
            return False
        held = layers[0].tokens_held()
        total = sum(int(lc.tokens_held().sum()) for lc in layers) // max(1, held.shape[0])
        if not method.scoring_pass_due(total, len(layers), int(held.shape[-1])):
            return False
        self.scoring = True
        try:
            for step in method.scoring_pass_inputs(context, encode, prefix):
                self.scoring_range = (start + step.lo, start + step.hi)
                forward(step.ids)
        finally:
            self.scoring = False
        method.finish_scoring_pass(layers)
        return True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _CURRENT.cache = self
        return self.layers[layer_idx].update(key_states, value_states)

    def share_prefill(self, others: list[CompressedCache]) -> None:
        """Let ``others`` take the same prompt in this cache's next (prefill) forward pass.

        Every method's prefill output is exact attention over the prompt, so the model's hidden
        states during prefill do not depend on the method: one forward pass can fill several
        caches. Each follower's method receives the same queries/keys/values and compresses them
        as its own prefill would; only this cache's attention output drives the model. Used to
        compare many methods on one prompt without re-running the whole model per method.
        """
        if any(layer.method.seen for layer in self.layers) or any(
            layer.method.seen for other in others for layer in other.layers
        ):
            raise RuntimeError("share_prefill needs caches that have not seen any token yet")
        if any(len(other.layers) != len(self.layers) for other in others):
            raise RuntimeError("share_prefill needs caches built for the same model")
        for i, layer in enumerate(self.layers):
            layer.followers = [other.layers[i] for other in others]

    def finish_prefill(self) -> None:
        """Join the prompt-time work the layers queued beside the prefill (ClusterKV's clustering
        on its own CUDA stream), so a timed first token includes it."""
        for layer in self.layers:
            if isinstance(layer.method, FastLayerCache):
                layer.method.finish_prefill()

    # -- steps replayed as CUDA graphs (engines/cuda_graph.py) ---------------------------------
    def graphable(self) -> bool:
        """Whether every layer is a fast layer, whose single-token steps a CUDA graph can replay."""
        return all(isinstance(layer.method, FastLayerCache) for layer in self.layers)

    def _fast_layers(self) -> Iterator[FastLayerCache]:
        for layer in self.layers:
            assert isinstance(layer.method, FastLayerCache)
            yield layer.method

    def before_step(self, t: int) -> None:
        """Every layer's host work before a step of ``t`` tokens (outside the graph)."""
        for lc in self._fast_layers():
            lc.before_step(t)

    def after_step(self, t: int) -> None:
        """Every layer's host counts after a step of ``t`` tokens."""
        for lc in self._fast_layers():
            lc.after_step(t)

    def graph_key(self) -> tuple[object, ...] | None:
        """The shapes and addresses a captured step depends on (a change means capturing again);
        ``None`` when a layer's next step must run eagerly (it does host work inside the step)."""
        keys = tuple(lc.graph_key() for lc in self._fast_layers())
        return None if any(k is None for k in keys) else keys

    def set_graphed(self, on: bool) -> None:
        """While on, layers run only a step's device work (the engine calls before/after_step)."""
        for lc in self._fast_layers():
            lc.graphed = on

    # -- what the cache holds -----------------------------------------------------------------
    def method_layers(self) -> Iterator[LayerCache]:
        """The per-layer method caches (sliding-window layers included)."""
        for layer in self.layers:
            yield layer.method

    def memory(self) -> dict[str, int]:
        """Bytes held over all layers, as the methods report them: ``kv`` payload, ``metadata``, ``total``."""
        out = {"kv": 0, "metadata": 0, "total": 0}
        for lc in self.method_layers():
            if lc.seen:
                for key, value in lc.memory().items():
                    out[key] += value
        return out

    def decode_read_bytes(self) -> int:
        """Bytes a decode step reads at least, over all layers (:meth:`LayerCache.decode_read_bytes`)."""
        return sum(lc.decode_read_bytes() for lc in self.method_layers() if lc.seen)

    def counters(self) -> dict[str, float]:
        """Per-method counters summed over layers; the method recomputes its rates from the sums."""
        total: dict[str, float] = {}
        for lc in self.method_layers():
            for key, value in lc.counters.items():
                total[key] = total.get(key, 0) + value
        return self.method_config.summarize_counters(total)

    def policy_ms(self) -> dict[str, float]:
        """The method's own work (selection, clustering, merging, quantising: the time of its
        prefill/decode calls less their attention) summed over layers, as ``policy_prefill_ms``
        and ``policy_decode_ms``; the same split our op reports. Empty on CUDA, where the calls
        return before the work ends."""
        if not any(layer.is_initialized and layer.device.type == "cpu" for layer in self.layers):
            return {}
        phases = ("prefill", "decode")
        return {f"policy_{ph}_ms": sum(layer.policy_ms[ph] for layer in self.layers) for ph in phases}

    def tokens_held(self) -> float:
        """Mean tokens (or merged tokens) held per KV head over the method's (non-sliding) layers."""
        held = [
            layer.method.tokens_held().float().mean().item()
            for layer in self.layers
            if not layer.is_sliding and layer.method.seen
        ]
        return sum(held) / len(held) if held else 0.0


def compressed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` over what the layer's method keeps; returns ``[b, t, heads, d]``.

    The causal structure comes from positions inside the method, so ``attention_mask`` (which
    transformers does not build for this implementation) must be ``None``: left-padded batches are
    not supported.
    """
    cache = getattr(_CURRENT, "cache", None)
    _CURRENT.cache = None  # never keep a finished sequence's cache alive from here
    idx = getattr(module, "layer_idx", None)
    layer = cache.layers[idx] if isinstance(cache, CompressedCache) and idx is not None else None
    if layer is None or layer.pending is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs past_key_values=CompressedCache(...) in every "
            "forward pass (this one used another cache or none) and attention modules with a layer_idx"
        )
    if attention_mask is not None:
        raise UserError("padded batches are not supported by the compressed cache: generate one sequence at a time")
    if softcap is not None and layer.method.softcap_refusal:
        raise UserError(f"attention logit soft-capping (Gemma 2): {layer.method.softcap_refusal}")
    if kwargs.get("s_aux") is not None:
        raise UserError("attention sinks (gpt-oss) are not supported by the compressed cache")
    if dropout:
        raise UserError("the compressed cache is for inference: attention dropout must be 0 (call model.eval())")
    k, v = layer.pending
    layer.pending = None
    lc = layer.method
    # (a scoring pass keeps nothing: the engines let it re-read a context of up to the window)
    beyond = sliding_window is not None and lc.seen + k.shape[2] > sliding_window
    if beyond and not layer.is_sliding and not cache.scoring:
        raise UserError(
            f"layer {idx} uses sliding-window attention ({sliding_window} tokens) on every layer; sequences "
            "longer than the window are not supported by the compressed cache"
        )
    lc.scale, lc.softcap = scaling, softcap
    phase = "decode" if lc.seen and not cache.scoring else "prefill"
    timed = query.device.type == "cpu"
    attended, t0 = lc.attend_ms, time.perf_counter()
    if cache.scoring:  # a scoring pass (run_scoring_pass): nothing of the step is kept
        out = lc.score_step(query, k, v, cache.scoring_range)  # a sliding layer attends its window
    elif lc.seen == 0:
        out = lc.prefill(query, k, v)
        memo = PromptMemo(query, k, v, out)  # the prompt's attention, reused by the followers
        for follower in layer.followers:  # same prompt, other methods (CompressedCache.share_prefill)
            follower.method.scale, follower.method.softcap = scaling, softcap
            follower.method.prompt_memo = memo
            try:
                follower.method.prefill(query, k, v)
            finally:
                follower.method.prompt_memo = None
        layer.followers = []
    else:
        out = lc.decode(query, k, v)
    if timed:  # the followers' prefills (share_prefill) are not this cache's work
        layer.policy_ms[phase] += max(0.0, (time.perf_counter() - t0) * 1e3 - (lc.attend_ms - attended))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, compressed_attention)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CompressedCache",
    "CompressedLayer",
    "ModelShape",
    "compressed_attention",
    "storage_bytes",
]
