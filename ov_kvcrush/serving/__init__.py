"""Serving many requests over one KV block pool: continuous batching with our op.

* :mod:`~ov_kvcrush.serving.scheduler`: which requests a step runs (admission, chunked prefill,
  preemption), pure bookkeeping;
* :mod:`~ov_kvcrush.serving.loop`: :class:`~ov_kvcrush.serving.loop.GenerationLoop`, the
  openvino backend's one generation loop, running the scheduler's steps on the op (every
  ``OpenVINOEngine`` has one); :mod:`~ov_kvcrush.serving.request` its requests and results;
* :mod:`~ov_kvcrush.serving.pipeline`: :class:`ContinuousBatchingPipeline`, the loop made from a
  model path, shaped like ``openvino_genai.ContinuousBatchingPipeline``;
* :mod:`~ov_kvcrush.serving.chat`: :class:`~ov_kvcrush.serving.chat.Chat`, a conversation on any backend;
* :mod:`~ov_kvcrush.serving.handle`: the :class:`GenerationHandle` a caller holds per request;
* :mod:`~ov_kvcrush.serving.request_queue`: the queue ``LLMPipeline`` serves other backends' calls from.

The pipeline (and the engines it pulls in) loads on first use: ``import ov_kvcrush`` and
``ov-kvcrush --help`` reach the request queue without it.
"""

from typing import Any

from ov_kvcrush.serving.handle import GenerationHandle, GenerationStatus

# Imported where used, inside functions: what pulls in numpy, torch, heavy to import, so that
# importing this module stays light.

__all__ = ["ContinuousBatchingPipeline", "GenerationHandle", "GenerationStatus"]


def __getattr__(name: str) -> Any:
    if name == "ContinuousBatchingPipeline":
        from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline

        return ContinuousBatchingPipeline
    raise AttributeError(f"module 'ov_kvcrush.serving' has no attribute {name!r}")
