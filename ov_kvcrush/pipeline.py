"""``LLMPipeline``: the one user-facing generation API, shaped like ``openvino_genai.LLMPipeline``.

Users of openvino_genai change a constructor argument, not their code::

    # before
    pipe = openvino_genai.LLMPipeline(model_dir, "CPU")
    print(pipe.generate("question", max_new_tokens=32))

    # after
    pipe = ov_kvcrush.LLMPipeline(model_dir, "CPU", backend="torch",
                                  compression=CompressionConfig(method="kvcrush", budget=256))
    result = pipe.generate("question", max_new_tokens=32)
    print(result)                      # the text, like openvino_genai's DecodedResults
    print(result.kv_bytes, result.tpot_ms, result.counters)

``generate`` takes a string (the chat template is applied, as openvino_genai does), a list of
chat messages, or a list of strings (one result each), plus either a
:class:`~ov_kvcrush.config.GenerationSettings` or its fields as keyword arguments, and an
optional streamer called with each new piece of text (return ``True`` to stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ov_kvcrush.config import CompressionConfig, GenerationSettings
from ov_kvcrush.engines import make_engine, resolve_model
from ov_kvcrush.engines.base import GenerationResult, Prompt, Streamer
from ov_kvcrush.errors import ConfigError, UserError

_SETTINGS_FIELDS = tuple(f.name for f in fields(GenerationSettings))


class LLMPipeline:
    """Generate text with KV-cache compression on any engine.

    Args:
        model: model path for the backend (an exported IR directory for ``genai``; an HF
            checkpoint or a GGUF file for ``torch``); ``None``: the embedded SmolLM2-135M.
        device: ``CPU`` (default); ``cuda`` for the torch backend on a GPU.
        backend: ``genai`` (native openvino_genai, default) or ``torch``.
        compression: a :class:`CompressionConfig`, or a method name (``"full"`` needs no budget).
        budget: shortcut for ``CompressionConfig(method=compression, budget=budget)``.
        **engine_options: passed to the engine (``dtype`` for torch, ``properties`` for genai).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "CPU",
        *,
        backend: str = "genai",
        compression: CompressionConfig | str | None = None,
        budget: int | None = None,
        **engine_options: Any,
    ) -> None:
        if compression is None or isinstance(compression, str):
            compression = CompressionConfig(method=compression or "full", budget=budget)
        elif budget is not None:
            raise UserError("pass budget inside the CompressionConfig, not beside it")
        if not isinstance(compression, CompressionConfig):
            raise ConfigError("compression", compression, "a CompressionConfig or a method name")
        self.compression = compression
        self.backend = backend
        self.engine = make_engine(backend, resolve_model(backend, model), compression, device, **engine_options)

    def generate(
        self,
        inputs: Prompt | Sequence[str],
        generation_config: GenerationSettings | None = None,
        streamer: Streamer | None = None,
        **kwargs: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (or each of a list of prompts, one after another).

        Keyword arguments override fields of ``generation_config`` (``max_new_tokens``,
        ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``apply_chat_template``).
        """
        unknown = sorted(set(kwargs) - set(_SETTINGS_FIELDS))
        if unknown:
            raise ConfigError(
                unknown[0], kwargs[unknown[0]], "a GenerationSettings field: " + ", ".join(_SETTINGS_FIELDS)
            )
        settings = replace(generation_config or GenerationSettings(), **kwargs)
        if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(p, str) for p in inputs):
            return [self.engine.generate(p, settings, streamer) for p in inputs]
        return self.engine.generate(inputs, settings, streamer)  # type: ignore[arg-type]
