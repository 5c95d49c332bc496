"""Plain transformers, no compression: the GPU baselines the torch engine is measured against.

Two rows of their own in ``ov-kvcrush bench`` (backends ``hf-sdpa`` and ``hf-static-compiled``):

* ``hf-sdpa``: ``model.generate`` with ``attn_implementation="sdpa"`` and the default
  ``DynamicCache``: what a user gets without this package (its prefill is the TTFT target);
* ``hf-static-compiled``: the same with ``cache_implementation="static"`` and
  ``CompileConfig(mode="reduce-overhead", fullgraph=True)``: a preallocated cache and a decode
  step compiled into CUDA graphs, transformers' fastest decode (the TPOT target). CUDA only
  (transformers compiles on CUDA only). Compilation and graph capture are not timed: the first
  generation at each prompt length runs once untimed before (``counters["warmup_runs"]``).

Both time each token as the streamer receives it (after its transfer to the host, so the step
has finished), as the torch engine does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer, step_ms, ttft_tpot_ms
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
        super().__init__(model_dir, compression, device=device, dtype=dtype)
        self.backend = backend
        self.warm_lengths: set[int] = set()

    def generate(
        self, prompt: Prompt, settings: GenerationSettings | None = None, streamer: Streamer | None = None
    ) -> GenerationResult:
        settings = settings or GenerationSettings()
        ids = self._prompt_ids(prompt, settings)
        warmups = 0
        if self.static and len(ids) not in self.warm_lengths:
            self._generate(ids, settings)  # compile and capture at this length, untimed
            self.warm_lengths.add(len(ids))
            warmups = 1
        clock = _TokenClock()
        out = self._generate(ids, settings, clock)
        tokens = out[len(ids) :]
        if not settings.ignore_eos:
            tokens = [t for t in tokens if t not in self.eos_ids]
        if streamer is not None:
            streamer(self.tokenizer.decode(tokens, skip_special_tokens=True))
        ttft_ms, tpot_ms = ttft_tpot_ms(clock.stamps)
        # the static cache holds its whole length from the start; the dynamic one every token
        # fed, which is all but the last generated
        kv = self.full_kv_bytes(len(ids) + settings.max_new_tokens if self.static else len(out) - 1)
        return GenerationResult(
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            token_ids=tokens,
            prompt_tokens=len(ids),
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            step_ms=step_ms(clock.stamps),
            kv_bytes=kv,
            full_kv_bytes=self.full_kv_bytes(len(out) - 1),
            peak_kv_bytes=kv,
            method="full",
            budget=None,
            backend=self.backend,
            counters={"warmup_runs": warmups},
        )

    def _generate(self, ids: list[int], settings: GenerationSettings, clock: _TokenClock | None = None) -> list[int]:
        from transformers.generation import CompileConfig

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
                torch.tensor([ids], device=self.device),
                max_new_tokens=settings.max_new_tokens,
                streamer=clock,
                pad_token_id=self.tokenizer.pad_token_id,
                **kw,
            )
        return out[0].tolist()
