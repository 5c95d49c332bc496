"""Configuration objects: dataclasses with documented defaults, validated on construction.

Every field error raises :class:`~ov_kvcrush.errors.ConfigError` naming the field and its allowed
range, so a bad CLI flag or a bad library call fails before any model is loaded.

:class:`CompressionConfig` is the one object users change to switch methods; each engine maps it
to its own mechanism (for the native engine: :func:`to_native_scheduler_config`, an
``openvino_genai.SchedulerConfig`` with ``CacheEvictionConfig`` / ``KVCrushConfig``; for the torch
engine: the method's reference config from :mod:`ov_kvcrush.methods`, whose fields are the
method's options).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.validation import MAX_TOKENS, check_choice, check_float, check_int

# Imported where used, inside functions: what pulls in numpy, openvino_genai, torch, heavy to
# import, so that importing this module stays light.

#: Native defaults for sinks and the recent window: whole CPU KV blocks (32 tokens each).
NATIVE_SINK_TOKENS = 32
NATIVE_RECENT_TOKENS = 128
#: Native importance aggregation modes we expose. ADAPTIVE_RKV is refused: in openvino_genai
#: 2026.4 it aborts with "Token diversity must be registered before each eviction".
AGGREGATIONS = ("sum", "norm_sum")


@dataclass(frozen=True)
class KVCrushSettings:
    """KVCrush's share of the budget and how its anchor is formed.

    Attributes:
        budget: tokens of the total budget given to KVCrush representatives (one per bucket); the
            rest of the budget goes to the important (H2O/SnapKV) tokens. ``None`` means a quarter
            of the evictable area, rounded down to whole blocks for the native engine.
        anchor: anchor point of the Hamming bucketing: ``random`` (seeded), ``zeros``, ``ones``,
            ``mean`` (per-bit majority) or ``alternating``.
        seed: seed of the random anchor, so runs are reproducible.
    """

    budget: int | None = None
    anchor: str = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_int("kvcrush.budget", self.budget, 0)
        from ov_kvcrush.methods.kvcrush import ANCHOR_MODES  # the native engine's modes too

        check_choice("kvcrush.anchor", self.anchor, ANCHOR_MODES)
        check_int("kvcrush.seed", self.seed, 0, 2**31 - 1)


@dataclass(frozen=True)
class CompressionConfig:
    """Which KV-cache compression to run and within what budget: the one object users change.

    Every engine reads the same object. The method's own semantics (and every option of it) are
    those of its reference config in :mod:`ov_kvcrush.methods` (``method_config()`` builds it);
    the native ``genai`` engine maps the subset it can run onto ``openvino_genai``'s eviction.

    Attributes:
        method: ``full`` (no compression) or any name in :data:`ov_kvcrush.methods.REGISTRY`:
            ``streamingllm``, ``h2o``, ``snapkv``, ``pyramidkv``, ``kvcrush``, ``clusterkv``,
            ``quest``, ``chelsea``, ``minikv``. The ``genai`` backend runs ``h2o``, ``snapkv``
            and ``kvcrush`` natively.
        budget: KV tokens kept per layer and KV head (sinks and recent window included; for
            recall methods, tokens attended per step). Required for every method but ``full``.
        sink_tokens: first tokens always kept. ``None``: the method's default (16 in the
            reference methods, 4 for StreamingLLM; 32, one KV block, on the ``genai`` backend).
        recent_tokens: newest tokens always kept. ``None``: the method's default (64; 128, four
            KV blocks, on ``genai``).
        options: any other field of the method's reference config, e.g.
            ``{"representatives": 64, "multi_anchor": "nearest"}`` for KVCrush,
            ``{"recall_cache_steps": 4}`` for ClusterKV or ``{"quant": True}`` (MiniKV's 2-bit
            store under any selection method). Unknown fields are refused by name.
        snapkv_window: ``genai`` only: observation window of native SnapKV/KVCrush scoring
            (the reference methods take ``window`` in ``options``).
        aggregation: ``genai`` only: ``sum`` accumulates attention; ``norm_sum`` divides by
            each token's lifetime.
        apply_rotation: ``genai`` only: re-rotate keys after eviction. Off by default: native
            rotation degrades output and fails on prompts past about twice the budget.
        kvcrush: ``genai`` only: native KVCrush's share and anchor (the reference KVCrush takes
            ``representatives``, ``anchor``, ``multi_anchor`` ... in ``options``).
    """

    method: str = "full"
    budget: int | None = None
    sink_tokens: int | None = None
    recent_tokens: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    snapkv_window: int = 8
    aggregation: str = "sum"
    apply_rotation: bool = False
    kvcrush: KVCrushSettings = field(default_factory=KVCrushSettings)

    def __post_init__(self) -> None:
        from ov_kvcrush.methods import REGISTRY

        check_choice("method", self.method, tuple(REGISTRY))
        if self.sink_tokens is not None:
            check_int("sink_tokens", self.sink_tokens, 0)
        if self.recent_tokens is not None:
            check_int("recent_tokens", self.recent_tokens, 1)
        if not isinstance(self.options, Mapping):
            raise ConfigError("options", self.options, "a mapping of method fields to values")
        for key in self.options:
            if not isinstance(key, str):
                raise ConfigError("options", dict(self.options), "a mapping whose keys are field names (strings)")
        for name in ("method", "budget", "sink_tokens", "recent_tokens"):
            if name in self.options:
                raise ConfigError(f"options.{name}", self.options[name], f"set through CompressionConfig.{name}")
        object.__setattr__(self, "options", dict(self.options))
        check_int("snapkv_window", self.snapkv_window, 1, 4096)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if not isinstance(self.apply_rotation, bool):
            raise ConfigError("apply_rotation", self.apply_rotation, "true or false")
        if not isinstance(self.kvcrush, KVCrushSettings):
            raise ConfigError("kvcrush", self.kvcrush, "a KVCrushSettings")
        if self.method == "full":
            if self.budget is not None:
                check_int("budget", self.budget, 1)
            if self.sink_tokens is not None or self.recent_tokens is not None or self.options:
                field_name = (
                    "options" if self.options else "sink_tokens" if self.sink_tokens is not None else "recent_tokens"
                )
                raise ConfigError(field_name, getattr(self, field_name), "unset for method full (nothing to tune)")
            return
        if self.budget is None:
            raise ConfigError("budget", None, f"an integer in [1, {MAX_TOKENS}] for method {self.method}")
        check_int("budget", self.budget, 1)
        self.method_config()  # the method validates its own fields, naming any bad one

    @property
    def compresses(self) -> bool:
        return self.method != "full"

    def method_config(self):
        """The reference config of the method (:class:`ov_kvcrush.methods.MethodConfig`) this describes."""
        from ov_kvcrush.methods import REGISTRY, method_config

        cls = REGISTRY[self.method]
        fields: dict[str, Any] = dict(self.options)
        if cls.needs_budget:
            fields["budget"] = self.budget
        if self.sink_tokens is not None:
            fields["sink_tokens"] = self.sink_tokens
        if self.recent_tokens is not None:
            fields["recent_tokens"] = self.recent_tokens
        return method_config(self.method, True, **fields)  # True: with the engines' defaults (product)

    @property
    def native_sink_tokens(self) -> int:
        """Sinks on the ``genai`` backend (default one CPU KV block)."""
        return NATIVE_SINK_TOKENS if self.sink_tokens is None else self.sink_tokens

    @property
    def native_recent_tokens(self) -> int:
        """Recent window on the ``genai`` backend (default four CPU KV blocks)."""
        return NATIVE_RECENT_TOKENS if self.recent_tokens is None else self.recent_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings shared by every engine.

    Attributes:
        max_new_tokens: tokens to generate at most (answers on the embedded model need up to ~20).
        do_sample: sample instead of greedy decoding.
        temperature, top_p, top_k, min_p: sampling parameters (ignored when greedy; ``min_p``:
            drop the tokens less likely than ``min_p`` times the likeliest).
        seed: sampling seed; ``None``: fresh randomness each request (OpenAI's default; the
            library's is 0, as openvino_genai's ``rng_seed``).
        repetition_penalty: every token of the prompt and of the answer so far has its logit
            divided by it where positive, multiplied where negative (1: none; greedy too).
        frequency_penalty, presence_penalty: OpenAI's: a token's logit less ``frequency_penalty``
            times its count in the answer so far, less ``presence_penalty`` once it is there
            (0: none; greedy too).
        min_new_tokens: end-of-sequence is not chosen before this many tokens.
        apply_chat_template: wrap a string prompt in the model's chat template, as
            ``openvino_genai`` does by default.
        ignore_eos: keep generating past the end-of-sequence token, up to ``max_new_tokens``
            (benchmarks time the same number of decode steps on every engine).
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    apply_chat_template: bool = True
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 1, 1 << 16)
        if not isinstance(self.do_sample, bool):
            raise ConfigError("do_sample", self.do_sample, "true or false")
        check_float("temperature", self.temperature, 0.0, 100.0, lo_open=True)
        check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top_k", self.top_k, 0, 1 << 20)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**31 - 1)
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_int("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        for name in ("apply_chat_template", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "true or false")


def native_block_size(device: str = "CPU") -> int:
    """KV block size of openvino_genai's paged attention on ``device`` (32 on CPU, 16 on GPU)."""
    return 16 if device.upper().startswith("GPU") else 32


def native_kvcrush_budget(config: CompressionConfig, block_size: int) -> int:
    """Tokens the native KVCrush gets: the configured share, or a quarter of the evictable area."""
    evictable = config.budget - config.native_sink_tokens - config.native_recent_tokens
    if config.kvcrush.budget is not None:
        return config.kvcrush.budget
    return (evictable // 4) // block_size * block_size


def check_native(config: CompressionConfig, block_size: int) -> None:
    """Refuse settings ``openvino_genai`` would reject or mis-handle, naming the field.

    Native eviction works on whole blocks: sinks, recent window and budget must be multiples of
    the block size (with ``budget > sink_tokens + recent_tokens`` from the base validation, that
    leaves at least one evictable block).
    """
    if not config.compresses:
        return
    from ov_kvcrush.methods import methods_for

    native = methods_for("genai")  # the methods mapped onto openvino_genai's cache eviction
    if config.method not in native:
        raise ConfigError("method", config.method, "one of " + ", ".join(native) + " (backend genai)")
    if config.options:
        raise ConfigError(
            "options",
            config.options,
            "empty on backend genai (native settings are snapkv_window, aggregation, apply_rotation, kvcrush)",
        )
    sinks, recent = config.native_sink_tokens, config.native_recent_tokens
    for name, value in (("sink_tokens", sinks), ("recent_tokens", recent), ("budget", config.budget)):
        if value <= 0 or value % block_size:
            raise ConfigError(
                name, value, f"a positive multiple of the native KV block size {block_size} (backend genai)"
            )
    if config.budget <= sinks + recent:
        raise ConfigError(
            "budget",
            config.budget,
            f"an integer in [{sinks + recent + 1}, {MAX_TOKENS}] (backend genai: above sink_tokens + recent_tokens)",
        )
    if config.method == "kvcrush":
        kb = native_kvcrush_budget(config, block_size)
        evictable = config.budget - sinks - recent
        if not 0 <= kb < evictable:
            raise ConfigError("kvcrush.budget", kb, f"an integer in [0, {evictable - 1}] (backend genai)")
        if kb % block_size:
            raise ConfigError(
                "kvcrush.budget", kb, f"a multiple of the native KV block size {block_size} (backend genai)"
            )


#: native ``openvino_genai``'s sparse prompt attention (``SparseAttentionConfig.mode``, lower case)
SPARSE_PREFILL = ("xattention", "trishape")


@dataclass(frozen=True)
class SparsePrefill:
    """Our op's sparse prompt attention (XAttention's antidiagonal block estimate; the reference
    and its departures: :mod:`ov_kvcrush.methods.sparse_prefill`). The fields are
    ``openvino_genai.SparseAttentionConfig``'s, whose names the errors use."""

    #: queries and keys per block (``xattention_block_size``); a multiple of 16 and of ``stride``
    block_size: int = 64
    #: every ``stride``-th row and column enters the estimate (``xattention_stride``)
    stride: int = 8
    #: the share of each query block's estimated mass its kept key blocks carry (``xattention_threshold``):
    #: the paper's 0.9 (native's default, 0.8, lost 8k needles here that 0.9 keeps: docs/benchmarks.md)
    threshold: float = 0.9
    #: the prompt's last rows that attend densely (``num_last_dense_tokens_in_prefill``)
    last_dense_tokens: int = 100
    #: the first (global) layers, which attend densely: ours, native has none. On the embedded
    #: SmolLM2 at 8k, at threshold 0.9, a passkey the dense prompt finds is lost with layers 0-1
    #: dense and kept with layers 0-3 dense (docs/benchmarks.md, "Our sparse prompt attention")
    dense_layers: int = 4

    def __post_init__(self) -> None:
        check_int("xattention_block_size", self.block_size, 16, 1024)
        if self.block_size % 16:
            raise ConfigError("xattention_block_size", self.block_size, "a multiple of 16 in 16..1024")
        check_int("xattention_stride", self.stride, 1, 64)
        if self.block_size % self.stride:
            raise ConfigError("xattention_stride", self.stride, f"1..64, dividing the block size {self.block_size}")
        check_float("xattention_threshold", self.threshold, 0.0, 1.0, lo_open=True)
        check_int("num_last_dense_tokens_in_prefill", self.last_dense_tokens, 0, MAX_TOKENS)
        check_int("dense_layers", self.dense_layers, 0, 4096)

    @classmethod
    def from_native(cls, sc: Any) -> SparsePrefill | None:
        """The settings of an ``openvino_genai.SchedulerConfig`` (``None``: its prompt attention
        is dense). Our op runs the ``XATTENTION`` mode; ``TRISHAPE`` is refused by name."""
        if not sc.use_sparse_attention:
            return None
        sa = sc.sparse_attention_config
        mode = str(sa.mode).rsplit(".", 1)[-1].lower()
        if mode != "xattention":
            raise ConfigError(
                "scheduler_config.sparse_attention_config.mode", mode.upper(),
                "XATTENTION (our op's sparse prompt attention; TRISHAPE runs on backend genai)",
            )  # fmt: skip
        return cls(
            block_size=int(sa.xattention_block_size),
            stride=int(sa.xattention_stride),
            threshold=round(float(sa.xattention_threshold), 6),  # the decimal the user set, not its f32
            last_dense_tokens=int(sa.num_last_dense_tokens_in_prefill),
        )


def to_native_scheduler_config(
    config: CompressionConfig,
    device: str = "CPU",
    *,
    cache_size_gb: int = 0,
    num_kv_blocks: int = 0,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = False,
    sparse_prefill: str | None = None,
):
    """Build the ``openvino_genai.SchedulerConfig`` that runs ``config`` natively.

    ``budget`` is the total the sequence may hold. Native KVCrush keeps its representative blocks
    *on top of* ``max_cache_size`` (measured: budget 256 + 2 KVCrush blocks held 352 tokens), so
    its share is carved out of the total here: ``max_cache_size = budget - kvcrush budget``.
    ``snapkv`` and ``kvcrush`` score the prompt with the last ``snapkv_window`` queries; ``h2o``
    sets the window to 0, i.e. importance accumulated from generation on, as in H2O. Prefix
    caching is off by default so that repeated prompts are measured honestly. ``sparse_prefill``:
    native's sparse prompt attention in that mode, with its own defaults (``None``: dense).
    """
    import openvino_genai as ov_genai

    block = native_block_size(device)
    check_native(config, block)
    sc = ov_genai.SchedulerConfig()
    if sparse_prefill is not None:
        check_choice("sparse_prefill", sparse_prefill, SPARSE_PREFILL)
        sc.use_sparse_attention = True
        sc.sparse_attention_config = ov_genai.SparseAttentionConfig(
            mode=getattr(ov_genai.SparseAttentionMode, sparse_prefill.upper())
        )
    if cache_size_gb:
        sc.cache_size = cache_size_gb
    if num_kv_blocks:
        sc.num_kv_blocks = num_kv_blocks
    if max_num_batched_tokens is not None:
        sc.max_num_batched_tokens = max_num_batched_tokens
    sc.enable_prefix_caching = enable_prefix_caching
    if not config.compresses:
        sc.use_cache_eviction = False
        return sc
    agg = {"sum": ov_genai.AggregationMode.SUM, "norm_sum": ov_genai.AggregationMode.NORM_SUM}[config.aggregation]
    kvcrush = None
    if config.method == "kvcrush":
        anchor = getattr(ov_genai.KVCrushAnchorPointMode, config.kvcrush.anchor.upper())
        kvcrush = ov_genai.KVCrushConfig(native_kvcrush_budget(config, block) // block, anchor, config.kvcrush.seed)
    window = config.snapkv_window if config.method in ("snapkv", "kvcrush") else 0
    sc.use_cache_eviction = True
    sc.cache_eviction_config = ov_genai.CacheEvictionConfig(
        start_size=config.native_sink_tokens,
        recent_size=config.native_recent_tokens,
        max_cache_size=config.budget - (native_kvcrush_budget(config, block) if kvcrush is not None else 0),
        aggregation_mode=agg,
        apply_rotation=config.apply_rotation,
        snapkv_window_size=window,
        kvcrush_config=kvcrush,
    )
    return sc


def parse_method_budget(method: str, budget: int | None, **overrides: Any) -> CompressionConfig:
    """CLI helper: build a config, turning dataclass ``TypeError`` into a one-line error."""
    try:
        return CompressionConfig(method=method, budget=budget, **overrides)
    except TypeError as exc:
        raise UserError(str(exc)) from None


#: the quantized stores a method item names after ``+`` (``snapkv+4bit``): widths of keys and values
STORE_WIDTHS = {"2bit": (2, 2), "4bit": (4, 4), "k2v4": (2, 4), "k4v2": (4, 2)}


def split_store(item: str, what: str = "methods") -> tuple[str, str]:
    """``name:KEY=VALUE+4bit`` -> (``name:KEY=VALUE``, ``4bit``); the store is ``""`` when none
    is named, and a store not in :data:`STORE_WIDTHS` is an error naming ``what``."""
    head, plus, store = item.rpartition("+")
    if not plus:
        return item, ""
    if store not in STORE_WIDTHS:
        raise ConfigError(what, item, "a method, optionally with :KEY=VALUE options and +" + ", +".join(STORE_WIDTHS))
    return head, store


def parse_options(items: Iterable[str], flag: str = "--option") -> dict[str, Any]:
    """``KEY=VALUE`` pairs as method options: JSON values (bare words stay strings, lists become
    tuples, ``-`` in keys becomes ``_``). A malformed pair is an error naming ``flag``."""

    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag} {item!r} is invalid: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip().replace("-", "_")] = tuples(value)
    return out


@dataclass(frozen=True)
class MethodSpec:
    """A method as the commands name it: a registry name, optionally with method options
    (``snapkv:block_size=32``) and over a quantized store (``name+2bit``, ``name+4bit``,
    ``name+k2v4`` for keys 2 and values 4 bits), e.g. ``snapkv:block_size=32+4bit``. The one
    parser of such items: ``eval``'s and ``bench``'s ``--methods`` and the GPU tools' read them
    here (:meth:`read`, :meth:`parse`)."""

    method: str
    quant: bool = False
    store: str = "2bit"
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def read(cls, text: str) -> MethodSpec:
        """The item as written, its method not looked up: a store not in :data:`STORE_WIDTHS`, a
        malformed option or a store named twice (``+4bit`` and ``:quant=``) is an error naming
        ``methods``."""
        return cls._written(text).one_store(text)

    @classmethod
    def _written(cls, text: str) -> MethodSpec:
        """The item's parts: a store not in :data:`STORE_WIDTHS` or no method name is an error
        naming ``methods``, a malformed option one naming the option."""
        head, store = split_store(text)
        name, *opts = head.split(":")
        if not name.strip():
            raise ConfigError("methods", text, "a method name, optionally followed by :KEY=VALUE options")
        options = parse_options(opts, flag=f"--methods {name.strip()}:")
        return cls(name.strip(), bool(store), store or "2bit", tuple(sorted(options.items())))

    def one_store(self, text: str) -> MethodSpec:
        """This spec, unless ``text`` named its store twice (``+4bit`` and ``:quant=``)."""
        if self.quant and any(key == "quant" for key, _ in self.options):
            raise ConfigError("methods", text, f"either +{self.store} or :quant=..., not both")
        return self

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """:meth:`read`, and the method looked up: a registry name, a store only where the method
        keeps one (not on MiniKV's default 2-bit store again), options its config takes."""
        from ov_kvcrush.methods import REGISTRY  # torch's import: not for `import ov_kvcrush`

        allowed = (
            "registry names ("
            + ", ".join(REGISTRY)
            + "), optionally with :KEY=VALUE options and +"
            + ", +".join(STORE_WIDTHS)
        )
        try:
            spec = cls._written(text)
        except ConfigError:
            raise ConfigError("methods", text, allowed) from None
        spec.one_store(text)
        name = spec.method
        if name not in REGISTRY:
            raise ConfigError("methods", text, allowed)
        field_ = REGISTRY[name].__dataclass_fields__.get("quant")
        quantized_already = field_ is not None and field_.default is not None  # MiniKV: 2-bit by default
        if spec.quant and (field_ is None or (quantized_already and spec.store == "2bit")):
            raise ConfigError(
                "methods", text, f"+{spec.store} on a method whose store is full precision ({name} cannot)"
            )
        if name != "full":
            spec.compression(None if not REGISTRY[name].needs_budget else 4096).method_config()  # names a bad option
        return spec

    @property
    def label(self) -> str:
        opts = "".join(f":{k}={v}" for k, v in self.options)
        return self.method + opts + (f"+{self.store}" if self.quant else "")

    def method_options(self) -> dict[str, Any]:
        """The options as :class:`CompressionConfig` takes them, the store as ``quant``'s widths."""
        options = dict(self.options)
        if self.quant:
            kbits, vbits = STORE_WIDTHS[self.store]
            options["quant"] = {"key_bits": kbits, "value_bits": vbits}
        return options

    def compression(self, budget: int | None, track_recall: bool = True) -> CompressionConfig:
        """The config at ``budget`` (recall methods also measure their top-B recall rate)."""
        from ov_kvcrush.methods import REGISTRY  # torch's import: not for `import ov_kvcrush`

        if self.method == "full":
            return CompressionConfig()
        options = self.method_options()
        if track_recall and "track_recall" in REGISTRY[self.method].__dataclass_fields__:  # a recall method
            options["track_recall"] = True
        # the windows are CompressionConfig's own fields, not method options
        sinks, recent = options.pop("sink_tokens", None), options.pop("recent_tokens", None)
        return CompressionConfig(self.method, budget, sink_tokens=sinks, recent_tokens=recent, options=options)


_SETTINGS_FIELDS = tuple(f.name for f in fields(GenerationSettings))


#: openvino_genai.GenerationConfig attributes -> GenerationSettings fields (a user's config carries over)
_NATIVE_SETTINGS = {
    "max_new_tokens": "max_new_tokens",
    "do_sample": "do_sample",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "rng_seed": "seed",
    "apply_chat_template": "apply_chat_template",
    "ignore_eos": "ignore_eos",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "min_new_tokens": "min_new_tokens",
}


def generation_settings(config: Any, overrides: Mapping[str, Any]) -> GenerationSettings:
    """The settings of a ``generate`` call: a :class:`GenerationSettings`, a mapping of its fields or an
    ``openvino_genai.GenerationConfig`` (its matching attributes), with keyword ``overrides``."""
    if config is None:
        base = GenerationSettings()
    elif isinstance(config, GenerationSettings):
        base = config
    elif isinstance(config, Mapping):
        fields_ = {str(k): v for k, v in config.items()}
        for key in fields_:
            if key not in _SETTINGS_FIELDS:
                raise ConfigError(f"generation_config.{key}", fields_[key], "a field of " + ", ".join(_SETTINGS_FIELDS))
        base = GenerationSettings(**fields_)
    elif type(config).__name__ == "GenerationConfig" and hasattr(config, "max_new_tokens"):
        base = GenerationSettings(
            **{ours: getattr(config, theirs) for theirs, ours in _NATIVE_SETTINGS.items() if hasattr(config, theirs)}
        )
    else:
        raise ConfigError(
            "generation_config",
            config,
            "a GenerationSettings, a mapping of its fields, an openvino_genai.GenerationConfig",
        )
    unknown = sorted(set(overrides) - set(_SETTINGS_FIELDS))
    if unknown:
        raise ConfigError(
            unknown[0], overrides[unknown[0]], "a GenerationSettings field: " + ", ".join(_SETTINGS_FIELDS)
        )
    return replace(base, **overrides)
