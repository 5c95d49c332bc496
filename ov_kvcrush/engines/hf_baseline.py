"""Plain transformers, no compression: the GPU baselines the torch engine is measured against.

Two rows of their own in ``ov-kvcrush bench`` (backends ``hf-sdpa`` and ``hf-static-compiled``):

* ``hf-sdpa``: ``model.generate`` with ``attn_implementation="sdpa"`` and the default
  ``DynamicCache``: what a user gets without this package (its prefill is the TTFT target);
* ``hf-static-compiled``: the same with ``cache_implementation="static"`` and
  ``CompileConfig(mode="reduce-overhead", fullgraph=True)``: a preallocated cache and a decode
  step compiled into CUDA graphs, transformers' fastest decode (the TPOT target). CUDA only
  (transformers compiles on CUDA only). Compilation and graph capture are not timed: the first
  generation at each prompt length and batch runs once untimed before (``counters["warmup_runs"]``).

Both time each token as the streamer receives it (after its transfer to the host, so the step
has finished), as the torch engine does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from transformers.generation import CompileConfig

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.base import (
    Capabilities,
    GenerationResult,
    Prompt,
    Streamer,
    equal_length_groups,
    step_ms,
    ttft_tpot_ms,
)
from ov_kvcrush.engines.sampling import refuse_host_sampler_settings
from ov_kvcrush.engines.torch_engine import TorchEngine
from ov_kvcrush.errors import ConfigError

#: backend name -> whether it runs the static cache compiled
HF_BASELINES = {"hf-sdpa": False, "hf-static-compiled": True}


class _TokenClock:
    """A transformers streamer that stamps each generated token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        return None


class HFBaselineEngine(TorchEngine):
    """transformers' own generation on the same model (see the module doc); method ``full`` only.

    Args:
        backend: ``hf-sdpa`` or ``hf-static-compiled``.
        model_dir, device, dtype: as :class:`~ov_kvcrush.engines.torch_engine.TorchEngine`
            (``random:<architecture>`` included).
    """

    attn_implementation = "sdpa"
    #: transformers' own cache: the full cache only, one sequence's generate at a time
    capabilities: ClassVar[Capabilities] = Capabilities(switches_compression=False, takes_method_options=False)

    def __init__(
        self,
        model_dir: Any,
        compression: CompressionConfig | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        backend: str = "hf-sdpa",
    ) -> None:
        if backend not in HF_BASELINES:
            raise ConfigError("backend", backend, "one of " + ", ".join(HF_BASELINES))
        if compression is not None and compression.method != "full":
            raise ConfigError("method", compression.method, f"full (backend {backend} is transformers' own cache)")
        self.static = HF_BASELINES[backend]
        if self.static and not device.lower().startswith(("cuda", "gpu")):
            raise ConfigError("device", device, "cuda (hf-static-compiled compiles CUDA graphs)")
        # transformers' own steps: never the fused kernels (they would also break its compiled graph)
        super().__init__(model_dir, compression, device=device, dtype=dtype, fused_ops=False)
        self.backend = backend
        self.warm_shapes: set[tuple[int, int]] = set()  # (rows, tokens) compiled and captured

    def generate(
        self, prompt: Prompt, settings: GenerationSettings | None = None, streamer: Streamer | None = None
    ) -> GenerationResult:
        settings = settings or GenerationSettings()
        refuse_host_sampler_settings(settings, self.backend)
        result = self._generate_rows([self._prompt_ids(prompt, settings)], settings)[0]
        if streamer is not None:
            streamer(result.text)
        return result

    def generate_batch(
        self, prompts: Sequence[Prompt], settings: GenerationSettings | None = None
    ) -> list[GenerationResult]:
        """transformers' batched generation, as :meth:`TorchEngine.generate_batch` batches:
        prompts of one token count in one ``model.generate`` call (no padding), other lengths in
        calls of their own; ``kv_bytes`` is a row's share."""
        settings = settings or GenerationSettings()
        refuse_host_sampler_settings(settings, self.backend)
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or not prompts:
            raise ConfigError("prompts", prompts, "a non-empty list of prompts")
        ids = [self._prompt_ids(p, settings) for p in prompts]
        results: list[GenerationResult | None] = [None] * len(ids)
        for group in equal_length_groups(ids):
            for i, result in zip(group, self._generate_rows([ids[i] for i in group], settings), strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    def _generate_rows(self, rows: list[list[int]], settings: GenerationSettings) -> list[GenerationResult]:
        """One ``model.generate`` over prompts of one length; a result per row."""
        warmups = 0
        shape = (len(rows), len(rows[0]))
        if self.static and shape not in self.warm_shapes:
            self._generate(rows, settings)  # compile and capture at this batch and length, untimed
            self.warm_shapes.add(shape)
            warmups = 1
        clock = _TokenClock()
        out = self._generate(rows, settings, clock)
        return [
            self._result(ids, row[len(ids) :], clock, settings, warmups, len(rows))
            for ids, row in zip(rows, out, strict=True)
        ]

    def _result(
        self,
        ids: list[int],
        generated: list[int],
        clock: _TokenClock,
        settings: GenerationSettings,
        warmups: int,
        rows: int = 1,
    ) -> GenerationResult:
        """One row's result: its own bytes; the bytes a step reads are the batch's (``rows``
        caches of this length), as :class:`TorchEngine`'s counters give them."""
        tokens = generated
        if not settings.ignore_eos:  # a row ends at its first EOS (a batch pads it on after)
            end = next((j for j, t in enumerate(generated) if t in self.eos_ids), len(generated))
            tokens = generated[:end]
        stamps = clock.stamps[: len(tokens) + (len(tokens) < len(generated))]
        ttft_ms, tpot_ms = ttft_tpot_ms(stamps)
        fed = len(ids) + len(generated) - 1  # every token fed, which is all but the last generated
        # the static cache holds its whole length from the start; the dynamic one every token fed
        kv = self.full_kv_bytes(len(ids) + settings.max_new_tokens if self.static else fed)
        return GenerationResult(
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            token_ids=tokens,
            prompt_tokens=len(ids),
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            step_ms=step_ms(stamps),
            kv_bytes=kv,
            full_kv_bytes=self.full_kv_bytes(fed),
            peak_kv_bytes=kv,
            method="full",
            budget=None,
            backend=self.backend,
            counters={"warmup_runs": warmups, "kv_read_bytes": kv * rows, **({"batch_rows": rows} if rows > 1 else {})},
        )

    def _generate(
        self, rows: list[list[int]], settings: GenerationSettings, clock: _TokenClock | None = None
    ) -> list[list[int]]:
        kw: dict[str, Any] = {}
        if self.static:
            kw = {
                "cache_implementation": "static",
                "compile_config": CompileConfig(mode="reduce-overhead", fullgraph=True),
            }
        if settings.do_sample:
            kw.update(do_sample=True, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
        else:
            kw.update(do_sample=False)
        if settings.ignore_eos:
            kw["min_new_tokens"] = settings.max_new_tokens
        if clock is not None:
            clock.t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor(rows, device=self.device),
                attention_mask=torch.ones((len(rows), len(rows[0])), dtype=torch.long, device=self.device),
                max_new_tokens=settings.max_new_tokens,
                streamer=clock,
                pad_token_id=self.tokenizer.pad_token_id,
                **kw,
            )
        return out.tolist()
