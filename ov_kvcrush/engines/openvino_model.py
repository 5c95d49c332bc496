"""The OpenVINO model with our paged-attention op, on CPU: the model, the block pool and one step.

The IR written by ``optimum-cli export openvino`` is read, converted in memory by
:func:`ov_kvcrush.transformations.convert_model` (each layer's SDPA and KV state become
``ov_kvcrush::PagedAttention``), and compiled on the CPU plugin with the extension library. The
KV cache lives in the extension: a :class:`~ov_kvcrush.op.kvcache.KVPool` per model and the
model's own :class:`SequenceCache` (a sequence and the ids it holds), whose handle is fed as the
model's ``kvc_sequence`` input. Everything else (weights, matmuls, RoPE, sampling inputs) is
OpenVINO's, so a step runs at the speed of the plugin plus our attention.

This module is the backend's lower half: :meth:`OpenVINOModel.forward` feeds one step, and the
step inputs of a batch of sequences are built here. Generating (sampling, stopping, streaming,
results, chat turns) is the one loop of :mod:`ov_kvcrush.serving.loop`;
:class:`~ov_kvcrush.serving.openvino_engine.OpenVINOEngine` puts the two together.

Tokenisation is openvino_tokenizers' (through ``openvino_genai.Tokenizer``, which runs the
``openvino_tokenizer.xml``/``openvino_detokenizer.xml`` models written by the export).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ov_kvcrush.config import CompressionConfig, SparsePrefill
from ov_kvcrush.engines import calibration
from ov_kvcrush.engines.base import Prompt, model_context
from ov_kvcrush.engines.genai import encode_prompt
from ov_kvcrush.engines.gpu_plugin_model import plugin_engine_model
from ov_kvcrush.engines.model_family import attention_softcap, check_family, layer_windows, sliding_context
from ov_kvcrush.engines.scheduler_config import compression_from_scheduler_config, pool_blocks_from_scheduler_config
from ov_kvcrush.engines.scoring_pass import ScoringPass
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.op import plugin, step_inputs
from ov_kvcrush.op.kvcache import DEFAULT_BLOCK_SIZE, PRECISIONS, KVPool, KVSequence, infer_steps
from ov_kvcrush.op.kvcache import block_bytes as kv_block_bytes
from ov_kvcrush.op.method_spec import method_spec
from ov_kvcrush.op.plugin import PluginError
from ov_kvcrush.transformations import convert_model
from ov_kvcrush.validation import check_choice

# Imported where used, inside functions: what pulls in openvino_genai, heavy to import, so that
# importing this module stays light.

if TYPE_CHECKING:
    from ov_kvcrush.engines.gpu_plugin_model import PluginModel

#: KV precision of the op's cache by default: u8, as OpenVINO's CPU plugin (and so native
#: openvino_genai) stores its cache on CPU; f16 and f32 on request.
DEFAULT_KV_PRECISION = "u8"


@dataclass(eq=False)
class SequenceCache:
    """A sequence of the pool and the token ids it holds, in order: the one record of what was fed
    to it. A chat's cache outlives each turn, and the next turn keeps the prefix it shares."""

    sequence: KVSequence
    ids: list[int] = field(default_factory=list)
    scored: int = 0  # of ``ids``, how many the method's scoring pass (KVzip) has scored
    #: a held prompt (serving/kept.py): a request that takes it leaves it holding the start of its
    #: prompt as fed before the method's selection, not what the method kept, so the next turn
    #: continues that prompt and selects with its own question in view, as its history sent cold
    #: does; and its ``ids`` are a prompt's earlier chunks, continued as the same prompt
    holds_prompt: bool = False

    def reset(self) -> None:
        """Free every block: the sequence holds nothing."""
        self.sequence.reset()
        self.ids = []
        self.scored = 0

    def keep_prefix(self, ids: list[int]) -> int:
        """Keep the longest prefix of ``ids`` the sequence holds (leaving at least one token of
        ``ids`` to feed); returns its length. A sequence that cannot drop tokens (the 2-bit
        store) is reset when it would have to, and one that takes no step of several tokens after
        its prompt (the 2-bit store on device GPU) when the rest is more than a token."""
        common = 0
        limit = min(len(self.ids), len(ids) - 1)
        while common < limit and self.ids[common] == ids[common]:
            common += 1
        if common and len(ids) - common > 1 and not self.sequence.several_tokens_after_prompt:
            self.reset()  # its next turn is fed whole, as a prompt
            return 0
        if common < len(self.ids):
            try:
                self.sequence.truncate(common)
            except PluginError:  # the 2-bit store cannot drop tokens: feed the conversation again
                self.reset()
                return 0
            self.ids = self.ids[:common]
            self.scored = min(self.scored, common)
        return common


class OpenVINOModel:
    """The exported IR whose attention is our paged-attention op: its pool and one step.

    Args:
        model_dir: directory written by ``ov-kvcrush export`` / ``optimum-cli export openvino``.
        compression: method and budget; every method whose config declares the ``openvino``
            engine (:func:`~ov_kvcrush.methods.methods_for`) runs inside the op (selection,
            eviction, the 2-bit store ...), as the torch reference defines it.
        device: ``CPU`` (the op, a CPU extension), or ``GPU`` (``GPU.N`` where the plugin lists
            several): an Intel GPU through OpenVINO's
            GPU plugin with our layers in place of its attention and the methods' kernels over
            the same pool (:mod:`ov_kvcrush.engines.gpu_plugin_model`; the methods whose config
            declares the ``gpu-plugin`` runtime, several sequences a step, prompts in chunks).
            Without an Intel GPU, ``GPU`` fails at once, naming what is missing.
        kv_precision: ``u8`` (default on CPU: 8-bit codes with a per-token min and scale, as native
            on CPU), ``f16`` (default on GPU) or ``f32`` storage of keys and values in the cache;
            openvino_genai's ``KV_CACHE_PRECISION`` property says the same.
        block_size: tokens per KV block (a multiple of 16; 32 as openvino_genai on CPU).
        max_kv_blocks: limit of the block pool (per layer and KV head blocks; 0: unlimited, on GPU
            the device's largest allocation: the pool is one buffer, which grows in chunks as
            blocks are asked for, up to the limit).
        scheduler_config: an ``openvino_genai.SchedulerConfig``: its ``num_kv_blocks`` /
            ``cache_size`` give the pool limit (instead of ``max_kv_blocks``); with
            ``use_cache_eviction``, its cache eviction settings the compression (instead of
            ``compression``); with ``use_sparse_attention`` in mode ``XATTENTION``, its
            ``sparse_attention_config`` our op's sparse prompt attention (instead of
            ``sparse_prefill``).
        sparse_prefill: ``xattention``: each prompt attends, per block of queries, the key
            blocks carrying most of its estimated attention (:class:`~ov_kvcrush.config.SparsePrefill`
            with its defaults; or one of those), as the genai engine's option of the same name
            names it; ``None``: dense. CPU only.
        properties: OpenVINO compile properties (e.g. ``{"INFERENCE_PRECISION_HINT": "f32"}``);
            the plugin's defaults otherwise, as openvino_genai uses.
    """

    def __init__(
        self,
        model_dir: str | Path,
        compression: CompressionConfig | None = None,
        device: str = "CPU",
        kv_precision: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_kv_blocks: int = 0,
        scheduler_config: Any = None,
        properties: dict | None = None,
        sparse_prefill: str | SparsePrefill | None = None,
    ) -> None:
        import openvino_genai as ov_genai

        self.device = str(device).upper()
        on_gpu = re.fullmatch(r"GPU(\.\d+)?", self.device) is not None
        if self.device != "CPU" and not on_gpu:
            raise ConfigError("device", device, "CPU, or GPU or GPU.N (an Intel GPU through OpenVINO's GPU plugin)")
        kv_precision = _kv_precision(kv_precision, properties, "f16" if on_gpu else DEFAULT_KV_PRECISION)
        _check_block_size("block_size", block_size)
        if isinstance(max_kv_blocks, bool) or not isinstance(max_kv_blocks, int) or max_kv_blocks < 0:
            raise ConfigError("max_kv_blocks", max_kv_blocks, "an integer >= 0 (0: unlimited)")
        self.model_dir = Path(model_dir)
        xml = self.model_dir / "openvino_model.xml"
        if not xml.is_file():
            raise UserError(f"not an exported OpenVINO model directory (no openvino_model.xml): {self.model_dir}")
        self.hf_config = _read_json(self.model_dir / "config.json")
        self.max_context = model_context(self.model_dir)
        windows = op_windows(self.hf_config, self.model_dir)
        #: the model's attention soft-capping (Gemma 2; 0: none), which the IR does not carry
        self.softcap = attention_softcap(self.hf_config)

        self.core = plugin.shared_core()
        self.properties = dict(properties or {})
        self.kv_precision = kv_precision
        #: our layers in OpenVINO's GPU plugin (device GPU), else None: the CPU op
        self.plugin: PluginModel | None = None
        if on_gpu:
            self.plugin = self._plugin_model(windows, kv_precision, block_size)
            self.shape = self.plugin.shape
        else:
            converted = self._converted(xml)
            self.shape = converted.shape
        if windows and len(windows) != self.shape.layers:
            raise UserError(
                f"{self.model_dir.name}: config.json names {len(windows)} layer types for "
                f"{self.shape.layers} attention layers"
            )
        #: per layer, a local layer's sliding-window span (0: global; all 0 for most models)
        self.windows = windows or [0] * self.shape.layers

        #: our op's sparse prompt attention (None: dense)
        self.sparse_prefill = _sparse_prefill(sparse_prefill)
        if scheduler_config is not None:
            compression, max_kv_blocks = self._read_scheduler_config(
                scheduler_config, compression, max_kv_blocks, block_size
            )
        if self.sparse_prefill is not None and self.plugin is not None:
            raise ConfigError("sparse_prefill", "xattention", "None on device GPU (our op's, device CPU)")
        #: what the one loop over this model is limited by (``None``: whole prompts, any number of sequences)
        self.scheduler_config = scheduler_config
        self.default_block_size = block_size
        if self.plugin is not None and not max_kv_blocks:
            max_kv_blocks = self.plugin.pool_limit()  # one buffer: the device's largest allocation
        self.max_kv_blocks = max_kv_blocks
        compression = compression or CompressionConfig()
        self.pool_spec(compression)  # a method the op refuses fails here, before the compilation
        if self.plugin is not None:
            self.compiled = self.plugin.compile()
        else:
            self.compiled = self.core.compile_model(converted.model, "CPU", self.properties)
            self.request = self.compiled.create_infer_request()  # a calibration in _make_pool runs it
        self.input_names = {p.get_any_name() for p in self.compiled.inputs}
        self.tokenizer = ov_genai.Tokenizer(str(self.model_dir))
        self.scoring = ScoringPass(self)  # the method's scoring pass (KVzip), shared with batching
        self._make_pool(compression)  # a method's calibration (Chelsea's "auto" outliers) runs here
        self.eos_ids = _eos_ids(self.model_dir, self.hf_config, self.tokenizer.get_eos_token_id())

    def _plugin_model(self, windows: list[int] | None, kv_precision: str, block_size: int) -> PluginModel:
        """Our layers in OpenVINO's GPU plugin for this model (device GPU), soft-capping its
        attention logits where the model does (Gemma 2)."""
        return plugin_engine_model(self.model_dir, windows, kv_precision, block_size, self.properties, self.device,
                                   self.softcap)  # fmt: skip

    def _converted(self, xml: Path) -> Any:
        """The IR with our op in its attention (device CPU); the op's prompt arithmetic follows the
        plugin's inference precision, as its own SDPA does."""
        self.library = plugin.loaded_path()
        hint = self.properties.get("INFERENCE_PRECISION_HINT") or self.core.get_property(
            "CPU", "INFERENCE_PRECISION_HINT"
        )
        self.attention_compute = "bf16" if any(t in str(hint).lower() for t in ("bf16", "bfloat16")) else "f32"
        return convert_model(
            self.core.read_model(xml), self.library, compute=self.attention_compute, softcap=self.softcap
        )

    def _read_scheduler_config(
        self, sc: Any, compression: CompressionConfig | None, max_kv_blocks: int, block_size: int
    ) -> tuple[CompressionConfig | None, int]:
        """openvino_genai's way of configuring the cache: ``(compression, pool limit)`` from its
        cache eviction settings and ``num_kv_blocks`` / ``cache_size``; one fact set twice is refused."""
        import openvino_genai as ov_genai

        if not isinstance(sc, ov_genai.SchedulerConfig):
            raise ConfigError("scheduler_config", sc, "an openvino_genai.SchedulerConfig")
        if sc.use_sparse_attention and self.sparse_prefill is not None:
            raise UserError("pass sparse_prefill or scheduler_config.use_sparse_attention, not both")
        self.sparse_prefill = SparsePrefill.from_native(sc) or self.sparse_prefill
        if sc.use_cache_eviction and compression is not None:
            raise UserError("pass compression or scheduler_config.use_cache_eviction, not both")
        if max_kv_blocks and (sc.num_kv_blocks or sc.cache_size):
            raise UserError("pass max_kv_blocks or scheduler_config's num_kv_blocks/cache_size, not both")
        if sc.use_cache_eviction or compression is None:
            compression = compression_from_scheduler_config(sc)  # never block-wise KVCrush
        s = self.shape
        block = kv_block_bytes(block_size, s.head_dim, self.kv_precision)
        return compression, max_kv_blocks or pool_blocks_from_scheduler_config(sc, s.layers, s.kv_heads, block)

    def _make_pool(self, compression: CompressionConfig) -> None:
        """The block pool and sequence of ``compression``'s method (the compiled model does not
        depend on the method: the op finds a sequence's pool by its handle)."""
        method, block_size, pool = self.new_pool(compression)
        self.close()  # the previous method's sequence and pool, if any
        self.compression, self.method = compression, method
        self.block_size = block_size
        self.block_bytes = kv_block_bytes(block_size, self.shape.head_dim, self.kv_precision)
        self.pool = pool
        #: the model's own sequence: what :meth:`forward` feeds, and a chat's cache
        self.cache = SequenceCache(pool.new_sequence())
        if self.plugin is not None:
            self.request = self.new_request()  # bound to this pool's buffer

    @property
    def sequence(self) -> KVSequence:
        """The model's own sequence (:attr:`cache`'s)."""
        return self.cache.sequence

    def new_pool(self, compression: CompressionConfig, count_only: bool = False) -> tuple[Any, int, KVPool]:
        """``(method config, block size, a new block pool)`` for ``compression``, as this engine
        holds its cache (the pool limit and precision included); the caller closes the pool.
        ``count_only``: a byte probe's pool (see :class:`~ov_kvcrush.op.kvcache.KVPool`)."""
        method, block_size, spec = self.pool_spec(compression)
        s = self.shape
        if self.plugin is not None:
            return method, block_size, self.plugin.new_pool(method, self.max_kv_blocks)
        pool = KVPool(
            s.layers, s.q_heads, s.kv_heads, s.head_dim, block_size=block_size, precision=self.kv_precision,
            max_blocks=self.max_kv_blocks, method=spec, windows=self.windows, count_only=count_only,
            sparse_prefill=self.sparse_prefill,
        )  # fmt: skip
        return method, block_size, pool

    def pool_spec(self, compression: CompressionConfig) -> tuple[Any, int, str]:
        """``(method config, block size, the op's spec)`` of ``compression``, checked."""
        method = self._calibrated(compression.method_config())
        return method, *self._method_spec(method)

    def check_compression(self, compression: CompressionConfig) -> None:
        """Raise :class:`~ov_kvcrush.errors.ConfigError` unless this engine runs ``compression``
        on its device (our op on the CPU, our layers in the GPU plugin), naming the field: a
        server's check of a request's method before it makes a pool (no calibration runs)."""
        self._method_spec(compression.method_config().model_free())

    def _method_spec(self, method: Any) -> tuple[int, str]:
        """``(block size, the op's spec)`` of ``method`` on this engine's device, checked."""
        block_size = self.default_block_size
        if self.plugin is not None:  # the layers are compiled for the engine's block size
            self.plugin.check_method(method)
            return block_size, method.name
        method_block = getattr(method, "block_size", None)
        if method_block is not None and block_size == DEFAULT_BLOCK_SIZE:
            _check_block_size("options.block_size", method_block)
            block_size = int(method_block)  # block-wise KVCrush evicts whole blocks of the pool
        return block_size, method_spec(method, self.shape.layers, self.shape.q_heads, block_size, self.windows)

    def _calibrated(self, method: Any) -> Any:
        """``method`` with what it calibrates on the model (:mod:`~ov_kvcrush.engines.calibration`);
        before the model is compiled, with a calibration over no layers (the op checks the rest)."""
        if not method.needs_calibration:
            return method
        if getattr(self, "tokenizer", None) is None:
            return method.with_calibration(method.calibrate([]))
        model = calibration.model_id(self.model_dir)
        plugin = self.plugin
        if plugin is not None:  # device GPU: the keys of a prompt through our layers in the GPU plugin
            return calibration.resolve(method, model, self.scoring.encode,
                                       lambda ids: plugin.layer_keys(ids, self.max_kv_blocks))  # fmt: skip
        return calibration.resolve(method, model, self.scoring.encode, lambda ids: calibration.op_layer_keys(self, ids))

    def set_compression(self, compression: CompressionConfig) -> None:
        """Switch method and budget for the next generations: a new pool, the model stays compiled
        (an evaluation compares many methods on one engine)."""
        if not isinstance(compression, CompressionConfig):
            raise ConfigError("compression", compression, "a CompressionConfig")
        self._make_pool(compression)

    def close(self) -> None:
        """Free the sequence and the pool (the model cannot run afterwards)."""
        if getattr(self, "cache", None) is not None:
            self.cache.sequence.free()
            self.cache = None  # type: ignore[assignment]
        if getattr(self, "pool", None) is not None:
            self.pool.close()
            self.pool = None  # type: ignore[assignment]
            if getattr(self, "plugin", None) is not None:  # its requests hold the pool's buffers
                self.plugin.let_go_of_closed_pools()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- prompts ------------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as raw text (no template, no special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).input_ids.data[0])

    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt``; strings get the chat template, as openvino_genai does."""
        return encode_prompt(self.tokenizer, prompt, apply_chat_template)

    def full_kv_bytes(self, tokens: int, block_size: int | None = None) -> int:
        """Bytes a full cache in this engine's precision holds for ``tokens`` tokens, in blocks of
        ``block_size`` tokens (default: the current pool's)."""
        bs = block_size or self.block_size
        per_head = sum(math.ceil(min(tokens, w or tokens) / bs) for w in self.windows)  # local layers: their window
        return per_head * self.shape.kv_heads * kv_block_bytes(bs, self.shape.head_dim, self.kv_precision)

    # -- model steps ----------------------------------------------------------------------------
    def new_request(self) -> Any:
        """An inference request over the compiled model (on GPU: bound to the pool's buffer)."""
        if self.plugin is not None:
            return self.plugin.new_request(self.pool)
        return self.compiled.create_infer_request()

    def run_step(self, request: Any, ids: list[list[int]], sequences: list[Any], past: list[int]) -> np.ndarray:
        """One inference of ``ids`` (a list per sequence, after its ``past`` tokens) through
        ``request``: the logits at each sequence's last token, ``[sequences, vocab]``. A
        ``RuntimeError`` leaves the sequences in an unknown state."""
        if self.plugin is not None:
            return self.plugin.run_step(request, ids, sequences)
        ragged = len({len(x) for x in ids}) > 1
        inputs = (self.ragged_step_inputs if ragged else self.step_inputs)(ids, sequences, past)
        infer_steps(request, inputs, [s.handle for s in sequences])
        out = request.get_output_tensor(0).data
        return np.array(out[0] if ragged else out[:, -1], dtype=np.float32)

    def forward(self, ids: list[int]) -> np.ndarray:
        """Feed ``ids`` after the cached tokens; the next-token logits (last position)."""
        if not ids:
            raise UserError("forward needs at least one token")
        past = len(self.cache.ids)
        n = len(ids)
        try:
            logits = self.run_step(self.request, [list(ids)], [self.sequence], [past])
        except RuntimeError as exc:
            self.cache.reset()  # a failed step leaves the layers out of step: start clean
            raise UserError(
                f"backend openvino failed on a {n}-token step after {past} tokens: {error_line(exc)}"
            ) from None
        self.cache.ids.extend(ids)
        return logits[0]

    def prefill(self, ids: list[int]) -> np.ndarray:
        """:meth:`forward` for a prompt; a first prompt (nothing cached) goes in as two chunks of
        one prompt (:meth:`KVSequence.set_prompt`, the method selects once over the whole of it):
        the largest multiple of :data:`~ov_kvcrush.op.step_inputs.FAST_STEP_TOKENS`, then
        the rest."""
        cut = len(ids) if self.cache.ids or self.plugin else step_inputs.fast_prompt_cut(len(ids))
        if cut == len(ids):
            return self.forward(ids)
        self.sequence.set_prompt(len(ids))
        self.forward(ids[:cut])
        return self.forward(ids[cut:])

    def scoring_pass(self) -> float:
        """The method's scoring pass (KVzip) over the tokens not scored yet, when the cache is over
        its budget (:class:`~ov_kvcrush.engines.scoring_pass.ScoringPass`). Returns its seconds
        (0: none ran)."""
        cache = self.cache
        if not cache.ids or not self.scoring.due(cache.sequence):
            return 0.0
        t0 = time.perf_counter()
        past = len(cache.ids)
        try:
            self.scoring.run(self.request, cache.sequence, cache.ids[cache.scored :], cache.scored)
        except RuntimeError as exc:
            raise UserError(
                f"backend openvino failed in the scoring pass after {past} tokens: {error_line(exc)}"
            ) from None
        cache.scored = past
        return time.perf_counter() - t0

    def sequence_counters(self, sequence: KVSequence) -> dict[str, Any]:
        """What a result reports of its sequence's cache: blocks, tokens, the method's time and counters."""
        stats = sequence.stats()
        counters: dict[str, Any] = {
            "kv_blocks_held": stats.blocks_held,
            "kv_block_bytes": stats.block_bytes,
            "kv_precision": self.kv_precision,
            "tokens_seen": stats.tokens_seen,
            "tokens_held_per_head": round(stats.tokens_held / (self.shape.layers * self.shape.kv_heads), 2),
            # per layer, the mean over its KV heads: a local layer's ring, a pyramid's budgets
            "tokens_held_per_layer": [round(float(x), 2) for x in sequence.head_tokens().mean(axis=1)],
            "kv_2bit_blocks_held": stats.qblocks_held,
            "policy_prefill_ms": round(stats.policy_prefill_ns / 1e6, 3),
            "policy_decode_ms": round(stats.policy_decode_ns / 1e6, 3),
            "scores_prefill_ms": round(stats.scores_prefill_ns / 1e6, 3),
            "scores_decode_ms": round(stats.scores_decode_ns / 1e6, 3),
            **sequence.method_counters(),
        }
        if stats.prefill_blocks_dense:  # the sparse prefill's share of a dense prompt's blocks
            counters["prefill_density"] = round(stats.prefill_density, 4)
            counters["sparse_estimate_ms"] = round(stats.sparse_estimate_ns / 1e6, 3)
        return counters

    def step_inputs(self, ids: list[list[int]], sequences: list[KVSequence], past: list[int]) -> dict[str, np.ndarray]:
        """One step of several sequences, equal token counts (:func:`step_inputs.step_inputs`)."""
        return step_inputs.step_inputs(self.input_names, ids, [s.handle for s in sequences], past)

    def ragged_step_inputs(
        self, ids: list[list[int]], sequences: list[KVSequence], past: list[int]
    ) -> dict[str, np.ndarray]:
        """One step of several sequences, any token counts (:func:`step_inputs.ragged_step_inputs`)."""
        return step_inputs.ragged_step_inputs(self.input_names, ids, [s.handle for s in sequences], past)


def _sparse_prefill(value: str | SparsePrefill | None) -> SparsePrefill | None:
    """The engine's ``sparse_prefill`` argument as the pool's settings (``xattention``: the defaults)."""
    if isinstance(value, str):
        check_choice("sparse_prefill", value, ("xattention",))
        return SparsePrefill()
    if value is not None and not isinstance(value, SparsePrefill):
        raise ConfigError("sparse_prefill", value, "'xattention', a SparsePrefill or None")
    return value


def _kv_precision(value: Any, properties: dict | None, default: str) -> str:
    """The op's KV precision: ``kv_precision``, else the ``KV_CACHE_PRECISION`` property users of
    openvino_genai pass (a string or an ``openvino.Type``), else ``default``; both set must agree."""
    prop = (properties or {}).get("KV_CACHE_PRECISION")
    if prop is not None:
        name = prop if isinstance(prop, str) else getattr(prop, "get_type_name", lambda: str(prop))()
        name = str(name).lower()
        if name not in PRECISIONS:
            allowed = "one of " + ", ".join(PRECISIONS) + " (backend openvino's op)"
            raise ConfigError("KV_CACHE_PRECISION", prop, allowed)
        if value is not None and value != name:
            raise ConfigError("kv_precision", value, f"{name}, as KV_CACHE_PRECISION says (or leave one out)")
        return name
    if value is None:
        return default
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ConfigError("kv_precision", value, "one of " + ", ".join(PRECISIONS))
    return value


def _check_block_size(name: str, value: Any) -> None:
    """The op's blocks: a multiple of 16 tokens in [16, 256]."""
    if isinstance(value, bool) or not isinstance(value, int) or value % 16 or not 16 <= value <= 256:
        raise ConfigError(name, value, "a multiple of 16 in [16, 256]")


def _eos_ids(model_dir: Path, hf_config: dict, tokenizer_eos: int) -> set[int]:
    """The tokens that end a generation: config.json's (else the tokenizer's), and generation_config.json's."""
    eos = hf_config.get("eos_token_id", tokenizer_eos)
    ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    g = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if g is not None:
        ids |= {int(e) for e in (g if isinstance(g, list) else [g])}
    return ids


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def op_windows(cfg: dict, model_dir: Path) -> list[int]:
    """Per layer, the sliding-window span the op gives a local layer (0: a global layer).

    Models with local and global layers (Gemma 3): the local layers keep a ring of
    ``sliding_window`` positions in the op and the method runs on the global ones, as in the torch
    engine. A model whose every layer slides (Mistral) is run within its window (its context is
    capped there, :func:`~ov_kvcrush.engines.model_family.sliding_context`), where a window changes
    nothing: the method runs on every layer, as in the torch engine. A family not verified is
    refused first.
    """
    check_family(cfg, model_dir.name)
    windows = layer_windows(cfg)
    return [0] * len(windows) if sliding_context(cfg) else windows


def error_line(exc: Exception) -> str:
    """The line of an OpenVINO error that says what went wrong (ours, or the pool's), else its last."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "ov_kvcrush" in ln or "exhausted" in ln:
            return ln
    return lines[-1] if lines else type(exc).__name__
