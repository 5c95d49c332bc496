"""Torch engine: a Hugging Face model generating through the compressed cache (CPU, or CUDA).

It is the end-to-end oracle of the project (every method's reference, on a real model) and the
CUDA path. The model is loaded once with ``attn_implementation="ov_kvcrush"``; every
:meth:`TorchEngine.generate` builds a fresh :class:`~ov_kvcrush.engines.hf_cache.CompressedCache`
for the sequence, runs the prompt in one forward pass, then decodes one token per forward pass.

Metrics, as in :class:`~ov_kvcrush.engines.base.GenerationResult`:

* ``kv_bytes``: everything the compressed cache holds at the end, read from the methods
  (payload incl. 2-bit scales, plus their metadata: scores, positions, centroids, degrees);
  tests check it against the tensors' storage measured independently
  (:func:`~ov_kvcrush.engines.hf_cache.storage_bytes`).
* ``full_kv_bytes``: what transformers' own ``DynamicCache`` would hold for the same tokens
  (keys and values in the model dtype; sliding-window layers at most their window).
* ``peak_kv_bytes``: the most the cache held after any forward pass.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines import calibration
from ov_kvcrush.engines.base import (
    Capabilities,
    GenerationResult,
    Prompt,
    Streamer,
    TextStream,
    chat_messages,
    check_context,
    context_prompt,
    equal_length_groups,
    generation_prefix,
    model_context,
    question_split,
    step_ms,
    ttft_tpot_ms,
)
from ov_kvcrush.engines.cuda_graph import GraphedDecoder
from ov_kvcrush.engines.fused_ops import fuse_model_ops, fused_forward
from ov_kvcrush.engines.hf_cache import ATTN_IMPLEMENTATION, CompressedCache, ModelShape
from ov_kvcrush.engines.random_model import is_random_model
from ov_kvcrush.engines.sampling import pick_rows, refuse_host_sampler_settings
from ov_kvcrush.engines.torch_model import load_model
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.gpu import HOSTS
from ov_kvcrush.gpu.device_layers import device_layer
from ov_kvcrush.gpu.layout import PoolShape
from ov_kvcrush.gpu.pool import DevicePool
from ov_kvcrush.kernels import use_triton
from ov_kvcrush.methods import LayerCache, MethodConfig, require
from ov_kvcrush.methods.runtimes import GPU_POOL

#: tokens per block of the GPU path's device pool (the CPU op's default block)
PAGED_BLOCK_SIZE = 32


class TorchEngine:
    """Generate with transformers through the project's compressed KV cache.

    Args:
        model_dir: a Hugging Face checkpoint directory (``ov_kvcrush.models.export.hf_checkpoint()``
            gives the embedded model's).
        compression: method and budget; any method of the registry.
        device: ``cpu`` (default) or ``cuda``.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``float16`` or ``bfloat16``.
        keep_cache: keep the last generation's cache in :attr:`last_cache` (and, after
            :meth:`generate_each`, every compression's in :attr:`last_caches`) for inspection
            (tests measure their tensors); off by default so the KV memory is freed after each call.
        fast_path: run each method's fast layer cache where it has one
            (:mod:`ov_kvcrush.fastpath`: the reference's results without its per-step host work);
            ``None`` (default): on CUDA, not on CPU, where the reference is the oracle.
        cuda_graphs: replay decode steps as CUDA graphs where every layer is a fast one
            (:mod:`ov_kvcrush.engines.cuda_graph`); ``None`` (default): on CUDA with the fast path.
        fused_ops: run the model's RMSNorms, rotary embeddings and SiLU gates on fused kernels
            (:mod:`ov_kvcrush.engines.fused_ops`: one launch each, transformers' rounding);
            ``None`` (default): with the fast path where the Triton kernels run (CUDA).
        paged_device: ``"opencl"`` keeps the KV cache in the Intel GPU path's device pool (an
            Intel GPU, or Intel's OpenCL CPU runtime) and runs the cache's steps there, in
            ``plugins/gpu``'s kernels (:mod:`ov_kvcrush.gpu.device_layers`: full, H2O, SnapKV,
            PyramidKV, MiniKV, KVCrush, ClusterKV; one sequence at a time), hosted from Python by
            pyopencl; ``"sycl"`` the same, with the device memory owned and the kernels launched by
            the C++ SYCL host (:mod:`ov_kvcrush.gpu.sycl_host`); ``None`` (default): the cache in
            torch tensors.
    """

    backend = "torch"
    capabilities: ClassVar[Capabilities] = Capabilities(
        shares_prompt=True,
        asks_question_after=True,
        tracks_recall=True,
        scores_continuations=True,
        solves_kv_bytes=True,
    )
    #: the attention the model is loaded with (the transformers baselines load ``sdpa``)
    attn_implementation = ATTN_IMPLEMENTATION

    def __init__(
        self,
        model_dir: str | Path,
        compression: CompressionConfig | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        keep_cache: bool = False,
        fast_path: bool | None = None,
        cuda_graphs: bool | None = None,
        fused_ops: bool | None = None,
        paged_device: str | None = None,
    ) -> None:
        if paged_device is not None and paged_device not in HOSTS:
            raise ConfigError("paged_device", paged_device, "None, " + " or ".join(map(repr, HOSTS)))
        if paged_device and (fast_path or device.lower() != "cpu"):
            raise ConfigError("paged_device", paged_device, "None with fast_path or a CUDA device")
        self.paged_device = paged_device
        self.last_pool: Any = None  # the last generation's device pool (paged_device), for inspection
        if fast_path is not None and not isinstance(fast_path, bool):
            raise ConfigError("fast_path", fast_path, "true, false or None (auto: on CUDA)")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ConfigError("cuda_graphs", cuda_graphs, "true, false or None (auto: on CUDA with the fast path)")
        self.keep_cache = keep_cache
        self._prefix: list[int] | None = None  # the chat template's generation prompt (scoring passes)
        self.last_cache: CompressedCache | None = None
        self.last_caches: list[CompressedCache] = []  # generate_each's, one per compression (keep_cache)
        self.set_compression(compression or CompressionConfig())
        self.model, self.tokenizer = load_model(model_dir, device, dtype, self.attn_implementation)
        self.device = self.model.device
        on_cuda = self.device.type == "cuda"
        self.fast_path = on_cuda if fast_path is None else fast_path
        if cuda_graphs and not (on_cuda and self.fast_path):
            raise ConfigError(
                "cuda_graphs", cuda_graphs, "false or None here (CUDA graphs need device cuda and fast_path)"
            )
        self.cuda_graphs = on_cuda and self.fast_path if cuda_graphs is None else cuda_graphs
        if fused_ops is not None and not isinstance(fused_ops, bool):
            raise ConfigError("fused_ops", fused_ops, "true, false or None (auto: with the fast path on CUDA)")
        self.fused_ops = self.fast_path and use_triton(self.device) if fused_ops is None else fused_ops
        if self.fused_ops:
            fuse_model_ops(self.model)
        self.model_dir = Path(model_dir)
        #: the model's context (from its config, as every engine reads it)
        # a random-weight architecture (random:<name>) has no files: its config gives the context
        self.max_context = (0 if is_random_model(model_dir) else model_context(self.model_dir)) or int(
            getattr(self.model.config.get_text_config(), "max_position_embeddings", 0) or 0
        )
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        #: layer count, heads, dtype ... : what the KV memory of this model depends on
        self.shape = ModelShape.from_config(self.model.config, self.model.dtype)
        self.method = self._calibrated(self.method)  # a calibration on the model (Chelsea's "auto" outliers)

    def set_compression(self, compression: CompressionConfig) -> None:
        """Switch method/budget for the next generations (the model stays loaded)."""
        if not isinstance(compression, CompressionConfig):
            raise ConfigError("compression", compression, "a CompressionConfig")
        method = compression.method_config()
        if self.paged_device:
            require(method, GPU_POOL.name)
        self.method = self._calibrated(method)
        self.compression = compression

    def _calibrated(self, method: Any) -> Any:
        """``method`` with what it calibrates on the model (:mod:`~ov_kvcrush.engines.calibration`)."""
        if not method.needs_calibration or getattr(self, "model", None) is None:
            return method  # before the model is loaded: calibrated once it is (__init__)
        return calibration.calibrate_hf(method, self.model, self.tokenizer, source=self.model_dir)

    # -- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt``; strings get the chat template (as openvino_genai does)."""
        messages = chat_messages(prompt, apply_chat_template)
        if messages is not None and not self.tokenizer.chat_template:
            if not isinstance(prompt, str):
                raise UserError(f"{self.model_dir} has no chat template: chat messages cannot be formatted")
            # as openvino_genai does for base models: the string goes in as raw text
            warnings.warn(f"{self.model_dir.name} has no chat template: the prompt is used as raw text", stacklevel=3)
            messages = None
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)  # the template has the BOS
        return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as raw text (no template, no special tokens)."""
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def full_kv_bytes(self, tokens: int) -> int:
        """Bytes transformers' ``DynamicCache`` holds for ``tokens`` tokens (sliding layers capped)."""
        return self.shape.full_kv_bytes(tokens)

    # -- generation ---------------------------------------------------------------------------
    def _model_ops(self) -> contextlib.AbstractContextManager[None]:
        """Around the model's forward passes: its rotary embedding fused where :attr:`fused_ops`."""
        return fused_forward() if self.fused_ops else contextlib.nullcontext()

    def _prompt_ids(self, prompt: Prompt, settings: GenerationSettings) -> list[int]:
        ids = self.encode(prompt, settings.apply_chat_template)
        self._check_length(len(ids), settings.max_new_tokens)
        return ids

    def _check_length(self, prompt_tokens: int, new_tokens: int) -> None:
        check_context(prompt_tokens, new_tokens, self.max_context)

    def _prefill(
        self, rows: list[list[int]], methods: list[MethodConfig], reserve: int = 0
    ) -> tuple[list[CompressedCache], torch.Tensor, float]:
        """One forward pass over the prompts ``rows`` (as many tokens each: a batch) filling one
        cache per method.

        Returns the caches, each row's last logits ``[rows, vocab]`` and the seconds the pass
        took. With more than one method the first cache leads and the others follow
        (:meth:`CompressedCache.share_prefill`): every method compresses the same prompt as its
        own prefill would, without running the model once per method.
        """
        caches = [
            CompressedCache(
                m,
                self.model.config,
                self.fast_path,
                reserve,
                self._device_layers(len(rows), len(rows[0]) + reserve) if self.paged_device else None,
            )
            for m in methods
        ]
        caches[0].share_prefill(caches[1:])
        with torch.inference_mode(), self._model_ops():
            t0 = time.perf_counter()
            out = self.model(
                input_ids=torch.tensor(rows, device=self.device),
                past_key_values=caches[0],
                use_cache=True,
                logits_to_keep=1,
            )
            for cache in caches:
                cache.finish_prefill()
            return caches, out.logits[:, -1], time.perf_counter() - t0

    def _device_layers(self, rows: int, tokens: int) -> Callable[[MethodConfig, int, int], LayerCache]:
        """Each layer's cache on the GPU path's device, in a pool of its own (one per cache) sized
        for ``tokens`` (every layer's KV heads, and room for one eviction's fresh blocks)."""

        if rows != 1:
            raise ConfigError("prompts", rows, f"1 at a time with paged_device={self.paged_device!r}")
        s = self.shape
        shape = PoolShape("f32", PAGED_BLOCK_SIZE, s.head_dim, s.q_heads // s.kv_heads)
        per_head = -(-tokens // PAGED_BLOCK_SIZE)
        pool = DevicePool(shape, (s.num_layers + 1) * s.kv_heads * per_head, host=self.paged_device or "opencl")
        self.last_pool = pool
        return lambda method, layer, layers: device_layer(method, layer, layers, pool, s.kv_heads, s.q_heads)

    def _step(self, cache: CompressedCache, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row through ``cache``; the next-token logits ``[rows, vocab]``."""
        with torch.inference_mode(), self._model_ops():
            x = torch.tensor([[t] for t in tokens], device=self.device)
            return self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def generate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        streamer: Streamer | None = None,
        question: str | None = None,
    ) -> GenerationResult:
        """Generate for one prompt; see :class:`GenerationResult` for the metrics.

        ``question``: the text ``prompt`` ends with; the cache then takes the context without it
        first (and compresses it: a method's prefill selection, KVzip's scoring pass), and the
        question comes as the next step: a question asked after compression."""
        settings = settings or GenerationSettings()
        refuse_host_sampler_settings(settings, "torch")
        ids, split = self._prompt_split(prompt, settings, question)
        caches, logits, prefill_s = self._prefill([ids[:split]], [self.method], settings.max_new_tokens)
        logits, more_s = self._finish_prompt(caches[0], ids, split, logits[0])
        return self._decode([ids], caches[0], self.compression, logits[None], prefill_s + more_s, settings, streamer)[0]

    def generate_batch(
        self, prompts: Sequence[Prompt], settings: GenerationSettings | None = None
    ) -> list[GenerationResult]:
        """Generate for several prompts at once; one result per prompt, in order, each what
        :meth:`generate` gives for that prompt alone (greedy tokens equal; sampling draws each
        row from its own generator seeded with ``settings.seed``).

        Prompts of the same token count form one batch: one prefill of ``[rows, tokens]``, then
        one decode step per token for every row (each row keeps its own method state: its
        selections, clusters, pages and scores; a finished row is fed on until the batch ends,
        and what it generates after its end is dropped). Prompts of other lengths form batches of
        their own, run one after the other: rows are never padded. A method with a scoring pass
        (KVzip) runs its prompts one at a time. ``ttft_ms`` is the batch's prefill, ``tpot_ms``
        its step, and ``kv_bytes`` a row's share of the batch's cache.
        """
        settings = settings or GenerationSettings()
        refuse_host_sampler_settings(settings, "torch")
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or not prompts:
            raise ConfigError("prompts", prompts, "a non-empty list of prompts")
        if self.method.scoring_pass:
            return [self.generate(p, settings) for p in prompts]
        ids = [self._prompt_ids(p, settings) for p in prompts]
        results: list[GenerationResult | None] = [None] * len(ids)
        for group in equal_length_groups(ids):
            rows = [ids[i] for i in group]
            caches, logits, prefill_s = self._prefill(rows, [self.method], settings.max_new_tokens)
            for i, result in zip(
                group, self._decode(rows, caches[0], self.compression, logits, prefill_s, settings), strict=True
            ):
                results[i] = result
        return [r for r in results if r is not None]

    def _prompt_split(
        self, prompt: Prompt, settings: GenerationSettings, question: str | None
    ) -> tuple[list[int], int]:
        """The prompt's ids and how many come before the question (all of them without ``question``)."""
        ids = self._prompt_ids(prompt, settings)
        if question is None:
            return ids, len(ids)
        context_ids = self.encode(context_prompt(prompt, question), settings.apply_chat_template)
        return ids, question_split(ids, context_ids)

    def _finish_prompt(
        self, cache: CompressedCache, ids: list[int], split: int, logits: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """After the prefill of ``ids[:split]``: the method's scoring pass (when it has one), then
        the question ``ids[split:]`` in one step over the compressed cache. Returns the logits of
        the prompt's last token and the seconds this took."""
        t0 = time.perf_counter()

        def forward(step: list[int]) -> object:
            x = torch.tensor([step], device=self.device)
            return self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)

        encode = lambda text: list(self.tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
        with torch.inference_mode():
            if cache.method_config.scoring_pass:
                if self._prefix is None:  # rendered once per engine
                    render = lambda m: self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)  # noqa: E731
                    self._prefix = generation_prefix(render if self.tokenizer.chat_template else None, encode)
                cache.run_scoring_pass(ids[:split], 0, encode, self._prefix, forward)
            if split < len(ids):
                logits = forward(ids[split:]).logits[0, -1]  # type: ignore[attr-defined]
        return logits, time.perf_counter() - t0

    def generate_each(
        self,
        prompt: Prompt,
        compressions: list[CompressionConfig],
        settings: GenerationSettings | None = None,
        question: str | None = None,
    ) -> list[GenerationResult]:
        """:meth:`generate` under each compression, sharing one forward pass over the prompt.

        The results are those of calling :meth:`generate` once per compression (prefill is exact
        attention for every method, so only the compressed caches differ); each result's
        ``ttft_ms`` is the shared pass. Evaluations use this to compare many methods per prompt.
        """
        settings = settings or GenerationSettings()
        refuse_host_sampler_settings(settings, "torch")
        configs = _check_compressions(compressions)
        ids, split = self._prompt_split(prompt, settings, question)
        caches, first, prefill_s = self._prefill(
            [ids[:split]], [self._calibrated(c.method_config()) for c in configs], settings.max_new_tokens
        )
        results = []
        self.last_caches = []
        for cfg in configs:
            cache = caches.pop(0)  # each cache is freed once decoded
            logits, more_s = self._finish_prompt(cache, ids, split, first[0])
            shared = len(configs) > 1
            results += self._decode([ids], cache, cfg, logits[None], prefill_s + more_s, settings, None, shared)
            if self.keep_cache:
                self.last_caches.append(cache)
        return results

    def score_continuation_each(
        self,
        context: list[int],
        continuation: list[int],
        compressions: list[CompressionConfig],
    ) -> list[ContinuationScore]:
        """Teacher-force ``continuation`` after ``context`` through each compression's cache.

        The context is prefilled once (shared, as in :meth:`generate_each`); then every
        continuation token is fed one decode step at a time, the way generation sees the
        compressed cache, and its negative log-likelihood and the greedy prediction at each step
        are recorded. This is the perplexity of long text under compression.
        """
        configs = _check_compressions(compressions)
        if not context or not continuation:
            raise UserError("score_continuation_each needs a non-empty context and continuation")
        self._check_length(len(context), len(continuation))
        caches, first, _ = self._prefill([list(context)], [self._calibrated(c.method_config()) for c in configs])
        out = []
        for cfg in configs:
            cache = caches.pop(0)
            logits, nll, pred = first[0], [], []
            for j, tok in enumerate(continuation):
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll.append(float(-logp[tok]))
                pred.append(int(torch.argmax(logits)))
                if j + 1 < len(continuation):
                    logits = self._step(cache, [tok])[0]
            mem = cache.memory()
            seen = next(iter(cache.method_layers())).seen
            out.append(
                ContinuationScore(
                    method=cfg.method,
                    budget=cfg.budget,
                    nll=nll,
                    predicted=pred,
                    kv_bytes=mem["total"],
                    full_kv_bytes=self.full_kv_bytes(seen),
                    counters=_clean(cache.counters()),
                )
            )
        return out

    def _decode(
        self,
        rows: list[list[int]],
        cache: CompressedCache,
        compression: CompressionConfig,
        logits: torch.Tensor,
        prefill_s: float,
        settings: GenerationSettings,
        streamer: Streamer | None = None,
        shared: bool = False,
    ) -> list[GenerationResult]:
        """Decode every row of ``cache`` from the prompts' last logits ``[rows, vocab]``, one step
        for all rows at a time, until each row meets EOS, the token limit or (one row) the
        streamer's stop; the batch ends when every row has."""
        n = len(rows)
        gens = [_generator(settings.seed) if settings.do_sample else None for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        ends = [0] * n  # a finished row's count of stamped steps (0: still running)
        stamps: list[float] = []
        peak = 0
        stream = TextStream(streamer, lambda t: self.tokenizer.decode(t, skip_special_tokens=True))
        t0 = time.perf_counter() - prefill_s  # the first token is due after the prefill
        graphed = GraphedDecoder(self.model, cache, n) if self.cuda_graphs and cache.graphable() else None
        picks: list[int] = []
        for step in range(settings.max_new_tokens):
            if step and graphed is not None:
                with self._model_ops():  # a capture records the fused kernels
                    logits = graphed.step(picks, len(rows[0]) + step - 1)
            elif step:
                logits = self._step(cache, picks)
            picks = pick_rows(logits, settings, gens)
            stamps.append(time.perf_counter() - t0)
            if graphed is None or graphed.last_eager:  # a replayed step changes no shape: no host walk
                peak = max(peak, cache.memory()["total"])
            for i, nxt in enumerate(picks):
                if ends[i]:
                    continue
                if nxt in self.eos_ids and not settings.ignore_eos:
                    ends[i] = step + 1
                    continue
                tokens[i].append(nxt)
                if stream.push(tokens[i]):
                    ends[i] = step + 1
            if all(ends):
                break
        self.last_cache = cache if self.keep_cache else None
        counters = self._decode_counters(cache, graphed, shared, n)
        return [
            self._result(rows[i], tokens[i], stamps[: ends[i] or len(stamps)], cache, compression, peak, counters)
            for i in range(n)
        ]

    def _decode_counters(
        self, cache: CompressedCache, graphed: GraphedDecoder | None, shared: bool, rows: int
    ) -> dict[str, Any]:
        """The cache's counters after a decode (summed over its rows), with its bytes."""
        mem = cache.memory()
        counters: dict[str, Any] = {
            **cache.counters(),
            **cache.policy_ms(),
            "kv_payload_bytes": mem["kv"],
            "kv_metadata_bytes": mem["metadata"],
            "kv_read_bytes": cache.decode_read_bytes(),
            "tokens_seen": next(iter(cache.method_layers())).seen,
            "tokens_held_per_head": round(cache.tokens_held(), 2),
        }
        if rows > 1:
            counters["batch_rows"] = rows
        if graphed is not None:
            counters["graph_captures"] = graphed.captures
        if shared:
            counters["shared_prefill"] = 1
            counters.pop("policy_prefill_ms", None)  # another cache's prefill ran the prompt
        return _clean(counters)

    def _result(
        self,
        ids: list[int],
        tokens: list[int],
        stamps: list[float],
        cache: CompressedCache,
        compression: CompressionConfig,
        peak: int,
        counters: dict[str, Any],
    ) -> GenerationResult:
        """One row's result; its bytes are its share of the batch's cache (every row holds alike)."""
        rows = int(counters.get("batch_rows", 1))
        total = cache.memory()["total"]
        ttft_ms, tpot_ms = ttft_tpot_ms(stamps)
        return GenerationResult(
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            token_ids=tokens,
            prompt_tokens=len(ids),
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            step_ms=step_ms(stamps),
            kv_bytes=total // rows,
            full_kv_bytes=self.full_kv_bytes(int(counters["tokens_seen"])),
            peak_kv_bytes=max(peak, total) // rows,
            method=compression.method,
            budget=compression.budget,
            backend=self.backend,
            counters=dict(counters),
        )


@dataclass
class ContinuationScore:
    """How one compression predicts a known continuation (see :meth:`TorchEngine.score_continuation_each`).

    Attributes:
        nll: negative log-likelihood (nats) of each continuation token.
        predicted: the greedy (argmax) token at each step, to compare with the full cache's.
        kv_bytes / full_kv_bytes: as in :class:`GenerationResult`, after the last step.
    """

    method: str
    budget: int | None
    nll: list[float]
    predicted: list[int]
    kv_bytes: int
    full_kv_bytes: int
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))


def _check_compressions(compressions: list[CompressionConfig]) -> list[CompressionConfig]:
    configs = list(compressions)
    if not configs:
        raise ConfigError("compressions", compressions, "a non-empty list of CompressionConfig")
    for c in configs:
        if not isinstance(c, CompressionConfig):
            raise ConfigError("compressions", c, "CompressionConfig items")
    return configs


def _clean(counters: dict[str, Any]) -> dict[str, Any]:
    """Counters rounded for JSON (NaN left as is)."""
    return {k: (round(v, 6) if isinstance(v, float) and not math.isnan(v) else v) for k, v in counters.items()}


def _generator(seed: int | None) -> torch.Generator:
    """A row's generator: seeded, or (``None``) from fresh randomness."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
