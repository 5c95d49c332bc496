"""Serving many requests over one KV block pool: continuous batching with our op.

* :mod:`~ov_kvcrush.serving.scheduler`: which requests a step runs (admission, chunked prefill,
  preemption), pure bookkeeping;
* :mod:`~ov_kvcrush.serving.pipeline`: :class:`ContinuousBatchingPipeline`, shaped like
  ``openvino_genai.ContinuousBatchingPipeline``, running the scheduler's steps on the op;
* :mod:`~ov_kvcrush.serving.handle`: the :class:`GenerationHandle` a caller holds per request.
"""

from ov_kvcrush.serving.handle import GenerationHandle, GenerationStatus
from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline

__all__ = ["ContinuousBatchingPipeline", "GenerationHandle", "GenerationStatus"]
