"""What every method shares: the config base class, the per-layer cache protocol and selection helpers.

The tensor layout and the reference attention are in :mod:`ov_kvcrush.methods.attention`.
Nothing here is CPU-specific: every tensor is created on the device of the inputs, so the same
code is the oracle on CPU and the CUDA path on a GPU.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.kernels.prefill import causal_prefill
from ov_kvcrush.methods.attention import AttentionOutput, ShapeError, attend, check_kv, check_query
from ov_kvcrush.methods.runtimes import REFERENCE, Declaration, check_declaration, engines_of
from ov_kvcrush.validation import check_int

# --------------------------------------------------------------------------------------------
# selection helpers shared by the eviction methods


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last dim, ties broken by the lower index, ascending.

    Deterministic on every device (``torch.topk`` leaves tie order unspecified), which the fast
    paths need to reproduce the same token choice.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ShapeError(f"k={k} must be in [0, {n}]")
    if k == 0:
        return torch.empty((*scores.shape[:-1], 0), dtype=torch.long, device=scores.device)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    return torch.sort(order[..., :k], dim=-1).values


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather tokens along dim 2 of ``x`` (``[b, h, n, ...]``) with per-head ``index`` ``[b, h, k]``."""
    idx = index
    while idx.dim() < x.dim():
        idx = idx.unsqueeze(-1)
    return torch.gather(x, 2, idx.expand(*index.shape, *x.shape[3:]))


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors (their storage as allocated, not an estimate)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def storage_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj`` (an independent measurement).

    Walks attributes, lists, tuples, dicts and sets, and counts each underlying storage once at
    its allocated size, so a "kept" slice that still pins a full-size tensor is counted in full.
    This is how tests check that what a cache reports is what it really holds.
    """
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
            return
        if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device)) or id(x) in seen_objects:
            return
        seen_objects.add(id(x))
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dict__"):
            for k, v in vars(x).items():
                if k != "config":  # frozen configs hold no tensors but may be shared
                    walk(v)

    walk(obj)
    return sum(storages.values())


# --------------------------------------------------------------------------------------------
# config base

#: The engines a method can declare (:attr:`MethodConfig.engines`).
ENGINES = ("torch", "openvino", "genai")


#: the prompt's last tokens a selecting method keeps out of the 2-bit store by default (a chat
#: template's question fits); see :class:`QuantSettings`
DEFAULT_PROMPT_TAIL = 64


@dataclass(frozen=True)
class QuantSettings:
    """MiniKV's quantized KV store (2 bits, or 4), usable under any selection method.

    Attributes:
        bits: bits per stored value: 2 (MiniKV, KIVI-2; 16 codes per int32) or 4 (KIVI-4,
            native OpenVINO's u4; 8 per int32).
        key_bits, value_bits: a width for keys or values alone (``None``: ``bits``), e.g. keys
            at 2 and values at 4.
        group_size: values sharing one fp16 scale and zero: keys are grouped per channel along
            tokens, values per token along channels. 16 by default (MiniKV, KIVI).
        residual_tokens: the newest tokens kept in full precision; when that many have
            accumulated they are quantized together (flushed every ``residual_tokens`` steps).
            A multiple of ``group_size``.
        prompt_tail: the prompt's last tokens kept in full precision for good (they usually hold
            the question). ``None``: :data:`DEFAULT_PROMPT_TAIL` for the selecting methods, 0 for
            the methods that re-encode or index their store (Chelsea, ClusterKV, Quest), which
            refuse any other value. 0 quantizes the prompt like the rest (MiniKV's paper).
    """

    bits: int = 2
    group_size: int = 16
    residual_tokens: int = 128
    prompt_tail: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None

    def __post_init__(self) -> None:
        for field_name, value in (("bits", self.bits), ("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if value is None and field_name != "bits":
                continue
            if isinstance(value, bool) or value not in (2, 4):
                raise ConfigError(f"quant.{field_name}", value, "2 or 4 (the packed widths implemented)")
        if self.group_size not in (16, 32, 64, 128):
            raise ConfigError("quant.group_size", self.group_size, "one of 16, 32, 64, 128")
        check_int("quant.residual_tokens", self.residual_tokens, self.group_size, 1 << 16)
        if self.residual_tokens % self.group_size:
            raise ConfigError(
                "quant.residual_tokens", self.residual_tokens, f"a multiple of quant.group_size={self.group_size}"
            )
        if self.prompt_tail is not None:
            check_int("quant.prompt_tail", self.prompt_tail, 0, 1 << 16)

    @property
    def kbits(self) -> int:
        """The keys' width."""
        return self.bits if self.key_bits is None else self.key_bits

    @property
    def vbits(self) -> int:
        """The values' width."""
        return self.bits if self.value_bits is None else self.value_bits

    @property
    def label(self) -> str:
        """``2bit``, ``4bit`` or ``k2v4`` (keys 2, values 4): how reports name the store."""
        return f"{self.kbits}bit" if self.kbits == self.vbits else f"k{self.kbits}v{self.vbits}"

    def pinned_tail(self, selecting: bool = True) -> int:
        """The prompt tail kept in full precision; ``selecting`` False: a method that cannot pin
        (Chelsea, ClusterKV, Quest), for which only 0 (or ``None``) is allowed."""
        if not selecting:
            if self.prompt_tail:
                raise ConfigError(
                    "quant.prompt_tail", self.prompt_tail, "0 for this method (its store is re-encoded or indexed)"
                )
            return 0
        return DEFAULT_PROMPT_TAIL if self.prompt_tail is None else self.prompt_tail


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method's config: a name in the registry and a factory for per-layer caches.

    Subclasses are frozen dataclasses whose ``__post_init__`` validates every field and raises
    :class:`~ov_kvcrush.errors.ConfigError` naming it.
    """

    name: ClassVar[str] = ""
    #: how the default departs from the method's paper, in a line (the module doc has the rest):
    #: the methods table's column
    departure: ClassVar[str] = ""
    #: whether the method keeps a bounded number of tokens (``budget`` is required).
    needs_budget: ClassVar[bool] = True
    #: the runtimes that run this method, and the options each refuses
    #: (:mod:`ov_kvcrush.methods.runtimes`: the reference, the CUDA fast path, our CPU op, our GPU
    #: plugin layers, the Intel GPU pool, native ``openvino_genai``). Every registered class
    #: declares its own: a subclass does not inherit its parent's (a test checks it). Every list
    #: of methods per runtime or engine, and every runtime's refusal, is derived from these.
    runtimes: ClassVar[Declaration] = {REFERENCE.name: ()}
    #: why a runtime a user would reach for does not run this method (runtime name -> the
    #: reason): the support table's cell and the runtime's refusal say it
    not_run_because: ClassVar[dict[str, str]] = {}
    #: the backends that run this method (``torch``, ``openvino``, ``genai``), derived from
    #: :attr:`runtimes`
    engines: ClassVar[tuple[str, ...]] = ("torch",)
    #: over the 2-bit store, whether the prompt's tail can stay pinned in full precision
    #: (``quant.prompt_tail``): not for a method that re-encodes its store (Chelsea) or indexes
    #: its tokens in flush order (ClusterKV)
    pins_prompt_tail: ClassVar[bool] = True
    #: whether a conversation's cache, kept between turns as the turn left it, answers a later
    #: turn as the whole history prefilled cold does: only the full cache. A cold prefill attends
    #: the whole history exactly and then selects with the last question in view; a compressed
    #: cache can only offer the next question what an earlier turn left (measured: KVzip's kept
    #: caches answered 3 of 10 where cold answered 5, ClusterKV's 4 where cold answered 7; issue
    #: 73 saw SnapKV's answer 0 where cold answered 9). So a server keeps these methods' prompts
    #: before their selection instead (serving/kept.py: held prompts).
    keeps_later_turns: ClassVar[bool] = False
    #: whether the method scores the cache with a second pass after each prompt (KVzip): the
    #: engine then feeds :meth:`scoring_pass_inputs` through the layers' :meth:`LayerCache.score_step`
    #: (the op's scoring mode) and calls :meth:`finish_scoring_pass`, when :meth:`scoring_pass_due`
    scoring_pass: ClassVar[bool] = False
    #: named sets of fields a user picks with ``preset=NAME`` (``minikv:preset=paper``), applied
    #: before the fields given beside it (which win). Where a method's defaults are the product's
    #: choice and depart from its paper, ``paper`` gives the paper's.
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: fields the product sets unless its user does (``method_config(name, True, ...)``, as
    #: :meth:`ov_kvcrush.config.CompressionConfig.method_config` calls it; below any preset): what
    #: an engine resolves on the model (Chelsea's ``outlier_heads="auto"``).
    #: A config built directly keeps its model-free defaults, so the reference runs without a model.
    engine_defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declaration(cls.__name__, cls.runtimes, cls.not_run_because)
        cls.engines = engines_of(cls.runtimes)

    @property
    def needs_calibration(self) -> bool:
        """Whether a field waits for a calibration on the model (Chelsea's ``outlier_heads="auto"``):
        an engine then prefills calibration text with a full cache and builds its layers from
        :meth:`calibrated` (``ov_kvcrush.engines.calibration``)."""
        return False

    def store_settings(self) -> QuantSettings | None:
        """MiniKV's 2-bit store under this method (a config with a ``quant`` option answers with
        it), or None: the full-precision store."""
        return None

    def calibrate(self, layer_keys: list[torch.Tensor]) -> dict[str, Any]:
        """The calibrated fields (JSON-able) from ``layer_keys``: one ``[1, kv_heads, n, d]`` per
        layer the method runs on, of a full cache's prefill."""
        return {}

    def with_calibration(self, fields: dict[str, Any]) -> MethodConfig:
        """This config with the fields :meth:`calibrate` returned (read back from a cache file)."""
        return self

    def calibration_key(self) -> str:
        """What a calibration depends on besides the model (part of its cache file's name)."""
        return self.name

    def model_free(self) -> MethodConfig:
        """This config with what waits for a calibration left out, for what does not depend on it
        where no model is at hand (checking the other options; a model-free run of the reference).
        The bytes a budget holds do depend on it: ``ov_kvcrush.eval.budget`` calibrates on noise."""
        return self

    def scoring_pass_due(self, held: int, layers: int, kv_heads: int) -> bool:
        """Whether a cache holding ``held`` tokens (summed over its layers and KV heads) needs a
        scoring pass now (a method with :attr:`scoring_pass`)."""
        return False

    def scoring_pass_inputs(
        self, context: Sequence[int], encode: Callable[[str], list[int]], prefix: Sequence[int]
    ) -> list[Any]:
        """The steps of a scoring pass over ``context`` (the tokens to score): each has ``ids`` (fed
        to the model) and ``lo``/``hi`` (the context tokens it scores, from the context's start);
        ``encode`` tokenizes text without a template, ``prefix`` is the chat template's
        generation prompt."""
        raise NotImplementedError(f"method {self.name} has no scoring pass")

    def finish_scoring_pass(self, layers: list[LayerCache]) -> None:
        """After a scoring pass: the selection over ``layers`` (the method's layer caches, in order)."""
        raise NotImplementedError(f"method {self.name} has no scoring pass")

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        """This method's own fields of the op's spec, for a model with ``layers`` layers, ``q_heads``
        query heads and the pool's ``block_size``: exactly the keys its C++ policy reads (the op
        has no defaults of its own; :mod:`ov_kvcrush.op.method_spec` adds the method's name, its
        per-layer budgets and the store). Raises :class:`~ov_kvcrush.errors.ConfigError` naming
        an option the op does not run."""
        raise NotImplementedError(f"method {self.name} declares no op fields")

    def summarize_counters(self, total: dict[str, float]) -> dict[str, float]:
        """The method's counters summed over layers, as a report shows them: a method whose
        counters include rates recomputes them from the summed counts here (engines sum counters
        without knowing what they mean)."""
        return total

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        """A fresh cache for one layer (``layer_idx`` in ``[0, num_layers)``)."""
        raise NotImplementedError

    def layer_budget(self, layer_idx: int, num_layers: int) -> int | None:
        """Tokens this layer may hold per KV head (``None``: unbounded)."""
        return getattr(self, "budget", None)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields plus ``method``, for JSON reports."""
        return {"method": self.name, **asdict(self)}


def check_layer(layer_idx: int, num_layers: int) -> None:
    """Validate a layer index against the layer count."""
    check_int("num_layers", num_layers, 1, 4096)
    check_int("layer_idx", layer_idx, 0, num_layers - 1)


# --------------------------------------------------------------------------------------------
# per-layer cache protocol


@dataclass
class PromptMemo:
    """The prompt's attention, computed once and offered to other methods' prefill of the same prompt.

    Every method's prefill attends the prompt exactly (causal, no bias), so when several methods
    take the same prompt (an evaluation comparing them) the output, and the per-head scores once
    one method has asked for them, need computing only once. :meth:`LayerCache._attend` uses the
    memo only for a call on the very tensors it was built from (same objects), without bias, key
    mask or window, so no other attention can be served from it.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    output: torch.Tensor
    with_scores: AttentionOutput | None = None


class LayerCache(ABC):
    """The compressed KV state of one layer of one batch, plus the attention over it.

    The engine calls :meth:`prefill` once with the whole prompt, then :meth:`decode` for every
    new token (or a few tokens at once, e.g. a new chat turn). Both return the attention output
    for the given queries computed over what the method keeps; the prefill output is exact (all
    methods compress after the prompt has been seen, as in their papers).

    ``counters`` holds per-method statistics (evictions, merges, cluster-cache hits ...), all
    plain numbers so they can go into JSON.
    """

    #: why this cache's kernels cannot soft-cap attention logits (Gemma 2), naming them; "" when
    #: they do (the reference does: :func:`~ov_kvcrush.methods.attention.cap_logits`)
    softcap_refusal: ClassVar[str] = ""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.seen = 0  # tokens appended so far (the next token's position)
        #: logit scale of the model's attention (``None``: ``1/sqrt(head_dim)``); engines set it
        #: from the attention module, since some families (Gemma) scale differently.
        self.scale: float | None = None
        #: the model's attention soft-capping (Gemma 2's ``attn_logit_softcapping``; ``None``:
        #: none), set beside :attr:`scale`
        self.softcap: float | None = None
        #: wall time (ms) spent in :meth:`_attend` on CPU tensors: the engine subtracts it from a
        #: step's time to report the method's own work (selection, clustering, merging ...).
        self.attend_ms = 0.0

    #: set by an engine around a prefill whose prompt attention is already known (:class:`PromptMemo`).
    prompt_memo: PromptMemo | None = None

    def _attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kw: Any) -> AttentionOutput:
        """:func:`attend` with this layer's logit scale (served from :attr:`prompt_memo` when it
        applies), timed into :attr:`attend_ms` on the CPU (CUDA calls return before the work ends)."""
        if queries.device.type != "cpu":
            return self._attend_untimed(queries, keys, values, **kw)
        t0 = time.perf_counter()
        try:
            return self._attend_untimed(queries, keys, values, **kw)
        finally:
            self.attend_ms += (time.perf_counter() - t0) * 1e3

    def _attend_untimed(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kw: Any
    ) -> AttentionOutput:
        memo = self.prompt_memo
        if (
            memo is not None
            and queries is memo.queries
            and keys is memo.keys
            and values is memo.values
            and kw.get("bias") is None
            and kw.get("key_mask") is None
            and kw.get("window") is None
        ):
            if not kw.get("return_scores"):
                return AttentionOutput(memo.output)
            if memo.with_scores is None:
                memo.with_scores = self._attend_any(queries, keys, values, **kw)
            scores = memo.with_scores.scores
            # each method gets its own scores: accumulators are updated in place while decoding
            return AttentionOutput(memo.with_scores.output, None if scores is None else scores.clone())
        return self._attend_any(queries, keys, values, **kw)

    def _attend_any(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kw: Any
    ) -> AttentionOutput:
        """A prompt attending itself (the same positions tensor for queries and keys, nothing
        else) takes the fused path in the model's dtype (:func:`~ov_kvcrush.kernels.prefill.causal_prefill`);
        everything else, and a prefill no fast path serves here, the reference :func:`attend`."""
        pos = kw.get("q_positions")
        if (
            self.softcap is None  # the fused kernel takes raw logits
            and pos is not None
            and pos is kw.get("k_positions")
            and pos.dim() == 1
            and all(kw.get(name) is None for name in ("bias", "key_mask", "window"))
        ):
            fast = causal_prefill(queries, keys, values, self.scale, return_scores=bool(kw.get("return_scores")))
            if fast is not None:
                return AttentionOutput(*fast)
        return attend(queries, keys, values, scale=self.scale, softcap=self.softcap, **kw)

    @abstractmethod
    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of the prompt over itself (causal), then the method's compression."""

    def decode(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Append the step's keys/values, attend the step's queries over what is held.

        Validates the step; on a cache that has seen nothing yet, the step is the prompt
        (:meth:`prefill`). Methods implement :meth:`_decode_step`.
        """
        check_kv(keys, values)
        check_query(queries, keys)
        if not self.seen:
            return self.prefill(queries, keys, values)
        return self._decode_step(queries, keys, values)

    def score_step(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scored: tuple[int, int]
    ) -> torch.Tensor:
        """One step of a scoring pass (:attr:`MethodConfig.scoring_pass`): attend what is held plus
        the step, score the held tokens at positions in ``scored`` (``[lo, hi)``), keep nothing
        of the step."""
        raise NotImplementedError(f"{type(self).__name__} has no scoring pass")

    @abstractmethod
    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One validated decode step on a cache that already holds the prompt."""

    @abstractmethod
    def tokens_held(self) -> torch.Tensor:
        """``[batch, kv_heads]`` tokens (or merged tokens) held per head."""

    @abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes held: ``kv`` (key/value payload incl. quantization scales), ``metadata``
        (scores, centroids, degrees, positions ...), ``total``."""

    def nbytes(self) -> int:
        """Total bytes held (``memory()['total']``)."""
        return self.memory()["total"]

    def decode_read_bytes(self) -> int:
        """Bytes a decode step must read from this layer at least: the bandwidth floor's share.
        Everything held, for a method that attends all it holds; a method that recalls a subset
        (ClusterKV, Quest) counts what its step reads to choose it and the subset."""
        return self.memory()["total"]

    def _start_prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Validate a prompt (shapes, one query per token, first call) and return its positions."""
        check_kv(keys, values)
        check_query(queries, keys)
        if self.seen:
            raise RuntimeError("prefill called twice on the same layer cache; use decode for later tokens")
        if queries.shape[2] != keys.shape[2]:
            raise ShapeError(
                f"prefill needs one query per prompt token: {queries.shape[2]} queries, {keys.shape[2]} keys"
            )
        return self._positions(keys.shape[2], keys.device)

    def _positions(self, t: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(self.seen, self.seen + t, device=device)
        self.seen += t
        return pos

    def _bump(self, key: str, amount: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + amount
