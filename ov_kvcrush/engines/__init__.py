"""Engines: the same ``generate`` API and :class:`GenerationResult` over different runtimes.

* ``genai`` (:mod:`~ov_kvcrush.engines.genai`): native ``openvino_genai`` (the anchor we compare
  against), on an exported IR;
* ``torch`` (:mod:`~ov_kvcrush.engines.torch_engine`): transformers through the project's
  compressed cache (the oracle, and the CUDA path), on a Hugging Face checkpoint;
* ``openvino``: the exported IR with our paged-attention op (``plugins/cpu``) in place of each
  layer's SDPA and KV state: its model runner is :mod:`~ov_kvcrush.engines.openvino_model` (one
  step over a pool); the loop that generates with it sits above, in :mod:`ov_kvcrush.serving`.

Each engine declares what it can do (:class:`~ov_kvcrush.engines.base.Capabilities`); which
engine a backend's name gives, and the model path it runs, is :mod:`ov_kvcrush.serving.backends`'.
Nothing here imports the serving loop, the server or the commands.
"""

from __future__ import annotations

from ov_kvcrush.engines.base import Capabilities, GenerationResult, Prompt, Streamer

__all__ = ["Capabilities", "GenerationResult", "Prompt", "Streamer"]
