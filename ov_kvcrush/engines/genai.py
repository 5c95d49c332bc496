"""Native engine: ``openvino_genai`` paged attention, full cache or its own eviction/KVCrush.

This is the anchor every other engine is compared against. It drives a
``ContinuousBatchingPipeline`` step by step (the same scheduler ``LLMPipeline`` uses when given a
``SchedulerConfig``) so that it can read, after every step, how many KV blocks the sequence really
holds (``PipelineMetrics.cache_usage`` × the pool's bytes): that is the ``kv_bytes`` it reports,
in the plugin's own KV precision (u8 with per-token scales on CPU by default).

Guards: the native pipeline fails, and then leaks its blocks, on some configurations (cache
rotation on eviction, ADAPTIVE_RKV aggregation, and in earlier releases prompts just past the
sink area with SnapKV). Those configurations are refused up front with a clear message; any other
native failure is turned into a :class:`~ov_kvcrush.errors.UserError` naming the configuration,
and the broken pipeline is dropped so the next call starts clean.
"""

from __future__ import annotations

import math
import secrets
import time
from pathlib import Path
from typing import Any, ClassVar

from ov_kvcrush.config import (
    CompressionConfig,
    GenerationSettings,
    native_block_size,
    to_native_scheduler_config,
)
from ov_kvcrush.engines.base import (
    Capabilities,
    GenerationResult,
    Prompt,
    Streamer,
    TextStream,
    chat_messages,
    check_context,
    model_context,
    step_ms,
    ttft_tpot_ms,
)
from ov_kvcrush.engines.signal_stack import own_signal_stack
from ov_kvcrush.errors import UserError

# Imported where used, inside functions: what pulls in numpy, openvino, openvino_genai, heavy to
# import, so that importing this module stays light.

#: Context the block pool is first sized for; it grows (the pipeline is rebuilt) for longer prompts.
DEFAULT_POOL_TOKENS = 8192


def native_generation_config(settings: GenerationSettings, eos: int) -> Any:
    """``settings`` as an ``openvino_genai.GenerationConfig`` (the prompt comes templated already)."""
    import openvino_genai as ov_genai

    gc = ov_genai.GenerationConfig()
    gc.max_new_tokens = settings.max_new_tokens
    gc.apply_chat_template = False
    gc.eos_token_id = eos
    gc.ignore_eos = settings.ignore_eos
    gc.min_new_tokens = settings.min_new_tokens
    gc.repetition_penalty = settings.repetition_penalty
    gc.frequency_penalty = settings.frequency_penalty
    gc.presence_penalty = settings.presence_penalty
    if settings.do_sample:
        gc.do_sample = True
        gc.temperature = settings.temperature
        gc.top_p = settings.top_p
        gc.top_k = settings.top_k
        gc.min_p = settings.min_p
        # no seed: a fresh one (native's own default is a fixed 0)
        gc.rng_seed = settings.seed if settings.seed is not None else secrets.randbelow(2**31)
    return gc


def encode_prompt(tokenizer, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
    """Token ids of ``prompt`` with an ``openvino_genai.Tokenizer`` (openvino_tokenizers' models).

    Strings get the chat template, as openvino_genai does; the openvino engine shares this, so both
    engines feed the model the same tokens.
    """
    messages = chat_messages(prompt, apply_chat_template)
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        text = prompt
    # a chat template writes its own BOS; raw text gets the tokenizer's special tokens
    ids = tokenizer.encode(text, add_special_tokens=messages is None).input_ids.data[0]
    return [int(i) for i in ids]


class NativeFailure(UserError):
    """openvino_genai raised during generation; the message names the configuration."""


class GenAIEngine:
    """Generate with native ``openvino_genai`` on an exported IR directory.

    Args:
        model_dir: directory written by ``ov-kvcrush export`` / ``optimum-cli export openvino``,
            or a ``.gguf`` file, which openvino_genai loads itself (for users who only have the GGUF).
        compression: method and budget (``full``, ``h2o``, ``snapkv``, ``kvcrush``).
        device: OpenVINO device, ``CPU`` by default.
        pool_tokens: tokens the KV block pool is sized for at first; grown on demand.
        properties: extra OpenVINO compile properties (e.g. ``{"KV_CACHE_PRECISION": "f16"}``).
        sparse_prefill: native's sparse prompt attention (``xattention`` or ``trishape``, as
            ``SchedulerConfig.use_sparse_attention`` with its defaults); ``None``: dense.
    """

    backend = "genai"
    #: openvino_genai fixes a pipeline's cache eviction at its start; its own settings, no method options
    capabilities: ClassVar[Capabilities] = Capabilities(switches_compression=False, takes_method_options=False)

    def __init__(
        self,
        model_dir: str | Path,
        compression: CompressionConfig | None = None,
        device: str = "CPU",
        pool_tokens: int = DEFAULT_POOL_TOKENS,
        properties: dict | None = None,
        sparse_prefill: str | None = None,
    ) -> None:
        import openvino_genai as ov_genai

        self.model_dir = Path(model_dir)
        # A GGUF file runs directly (openvino_genai reads GGUF itself, no export step).
        self.is_gguf = self.model_dir.is_file() and self.model_dir.suffix.lower() == ".gguf"
        if not self.is_gguf and not (self.model_dir / "openvino_model.xml").is_file():
            raise UserError(
                f"not an exported OpenVINO model directory (no openvino_model.xml) nor a .gguf file: {self.model_dir}"
            )
        self.compression = compression or CompressionConfig()
        self.device = device
        self.max_context = model_context(self.model_dir)
        self.block_size = native_block_size(device)
        self.properties = dict(properties or {})
        self.sparse_prefill = sparse_prefill
        # Validates block multiples, the sparse mode etc. before any compile work.
        to_native_scheduler_config(self.compression, device, sparse_prefill=sparse_prefill)
        self._pool_blocks = 0
        self._pipe = None
        self._ensure_pool(pool_tokens)
        self.tokenizer: ov_genai.Tokenizer = self._pipe.get_tokenizer()

    # -- pipeline lifecycle -------------------------------------------------------------------
    def _ensure_pool(self, tokens: int) -> None:
        """(Re)build the pipeline when the pool cannot hold ``tokens`` plus slack blocks.

        Native eviction keeps the whole prompt during prefill, so the pool must fit the full
        sequence even when the budget is small.
        """
        need = math.ceil(tokens / self.block_size) + 2
        if self._pipe is not None and need <= self._pool_blocks:
            return
        import openvino_genai as ov_genai

        blocks = max(need, self._pool_blocks * 2)
        sc = to_native_scheduler_config(
            self.compression,
            self.device,
            num_kv_blocks=blocks,
            max_num_batched_tokens=max(blocks * self.block_size, 256),
            sparse_prefill=self.sparse_prefill,
        )
        self._pipe = None
        self._pipe = ov_genai.ContinuousBatchingPipeline(str(self.model_dir), sc, self.device, self.properties)
        own_signal_stack()  # its CPU plugin, dropped later, must not leave the thread a freed one
        self._pool_blocks = blocks
        self._block_bytes = 0  # the pool is allocated on the first step; read it then

    def _read_block_bytes(self) -> int:
        if not self._block_bytes:
            self._block_bytes = self._pipe.get_metrics().cache_size_in_bytes // self._pool_blocks
        return self._block_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V), in the plugin's KV precision.

        Zero until the first generation has allocated the pool.
        """
        return self._block_bytes

    # -- prompts ------------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as raw text (no template, no special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).input_ids.data[0])

    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt``; strings get the chat template, as openvino_genai does."""
        return encode_prompt(self.tokenizer, prompt, apply_chat_template)

    def _check_request(self, prompt_tokens: int, settings: GenerationSettings) -> None:
        """Refuse requests past the model's context, and those the native pipeline is known to fail
        on, before it can fail (openvino_genai itself runs past the context and answers garbage)."""
        check_context(prompt_tokens, settings.max_new_tokens, self.max_context)
        cfg = self.compression
        if not cfg.compresses:
            return
        total = prompt_tokens + settings.max_new_tokens
        if cfg.apply_rotation and total > cfg.budget:
            raise UserError(
                f"apply_rotation=True is refused for backend genai when the sequence ({prompt_tokens} prompt + "
                f"{settings.max_new_tokens} new tokens) exceeds budget={cfg.budget}: openvino_genai's CPU paged "
                "attention fails on the first rotated eviction and leaks its blocks; use apply_rotation=False"
            )

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        streamer: Streamer | None = None,
    ) -> GenerationResult:
        """Generate for one prompt; see :class:`GenerationResult` for the metrics."""
        import numpy as np
        import openvino as ov

        settings = settings or GenerationSettings()
        ids = self.encode(prompt, settings.apply_chat_template)
        self._check_request(len(ids), settings)
        self._ensure_pool(len(ids) + settings.max_new_tokens)

        eos = self.tokenizer.get_eos_token_id()
        gc = native_generation_config(settings, eos)
        pipe = self._pipe
        input_ids = ov.Tensor(np.asarray([ids], dtype=np.int64))
        step_times: list[float] = []
        blocks_held: list[int] = []
        tokens: list[int] = []
        stream = TextStream(streamer, self.tokenizer.decode)
        try:
            t0 = time.perf_counter()
            handle = pipe.add_request(0, input_ids, gc)
            while pipe.has_non_finished_requests():
                pipe.step()
                now = time.perf_counter()
                usage = pipe.get_metrics().cache_usage
                self._read_block_bytes()
                blocks_held.append(round(usage / 100.0 * self._pool_blocks))
                new = []
                if handle.can_read():
                    for out in handle.read().values():
                        new.extend(int(t) for t in out.generated_ids)
                if new:
                    step_times.append(now - t0)
                    tokens.extend(new)
                    if stream.push(tokens):
                        handle.stop()
        except RuntimeError as exc:
            self._pipe = None  # the native pipeline leaks blocks after a failure: rebuild next call
            self._pool_blocks = 0
            self._ensure_pool(len(ids) + settings.max_new_tokens)
            first = str(exc).strip().splitlines()
            detail = first[-1] if first else type(exc).__name__
            raise NativeFailure(
                f"openvino_genai failed for method={self.compression.method} budget={self.compression.budget} "
                f"on a {len(ids)}-token prompt: {detail}"
            ) from None
        if tokens and tokens[-1] == eos and not settings.ignore_eos:
            tokens = tokens[:-1]
        text = self.tokenizer.decode(tokens) if tokens else ""
        ttft_ms, tpot_ms = ttft_tpot_ms(step_times)
        # Blocks the full cache would hold for the same sequence: every prompt and generated token.
        full_blocks = math.ceil((len(ids) + len(step_times)) / self.block_size)
        return GenerationResult(
            text=text,
            token_ids=tokens,
            prompt_tokens=len(ids),
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            step_ms=step_ms(step_times),
            kv_bytes=blocks_held[-1] * self._block_bytes if blocks_held else 0,
            full_kv_bytes=full_blocks * self._block_bytes,
            peak_kv_bytes=max(blocks_held, default=0) * self._block_bytes,
            method=self.compression.method,
            budget=self.compression.budget,
            backend=self.backend,
            counters={
                "kv_blocks_held": blocks_held[-1] if blocks_held else 0,
                "kv_block_bytes": self._block_bytes,
            },
        )
