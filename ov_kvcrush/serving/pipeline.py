"""``ContinuousBatchingPipeline``: the openvino backend's one loop (:mod:`ov_kvcrush.serving.loop`)
made as ``openvino_genai.ContinuousBatchingPipeline`` is, from a model path and a scheduler
config (what OpenVINO Model Server serves)::

    pipe = ContinuousBatchingPipeline(model_dir, scheduler_config, compression=CompressionConfig("kvcrush", 1024))
    results = pipe.generate(prompts, GenerationSettings(max_new_tokens=64))      # one result per prompt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.openvino_model import OpenVINOModel
from ov_kvcrush.errors import UserError
from ov_kvcrush.serving.backends import resolve_model
from ov_kvcrush.serving.loop import GenerationLoop, check_scheduler_config
from ov_kvcrush.serving.openvino_engine import OpenVINOEngine


class ContinuousBatchingPipeline(GenerationLoop):
    """Serve many requests over one KV block pool with our op (:class:`~ov_kvcrush.serving.loop.GenerationLoop`).

    Args:
        model: an exported IR directory (``None``: the embedded model), or an
            :class:`~ov_kvcrush.serving.openvino_engine.OpenVINOEngine` to share (its compiled
            model, tokenizer, compression and pool: ``scheduler_config`` then gives only the
            scheduling limits).
        scheduler_config: an ``openvino_genai.SchedulerConfig``: ``max_num_seqs``,
            ``max_num_batched_tokens``, ``dynamic_split_fuse``, the pool (``num_kv_blocks`` /
            ``cache_size``) and, with ``use_cache_eviction``, the compression; ``None``: its defaults.
        device: ``CPU``.
        compression: our method and budget (instead of the scheduler config's cache eviction).
        **engine_options: :class:`OpenVINOEngine` options (``kv_precision``, ``block_size``,
            ``max_kv_blocks``, ``properties``).
    """

    def __init__(
        self,
        model: str | Path | OpenVINOModel | None = None,
        scheduler_config: Any = None,
        device: str = "CPU",
        *,
        compression: CompressionConfig | None = None,
        **engine_options: Any,
    ) -> None:
        sc = check_scheduler_config(scheduler_config)
        if isinstance(model, OpenVINOModel):  # its compression and pool are set: sc gives only the limits
            if compression is not None or engine_options:
                raise UserError("a shared engine brings its own compression and pool: pass only scheduler_config")
            engine = model
        else:  # the engine reads the pool limit (and, with cache eviction, the compression) from sc
            path = resolve_model("openvino", model)
            engine = OpenVINOEngine(path, compression, device, scheduler_config=sc, **engine_options)
        super().__init__(engine, sc)


__all__ = ["ContinuousBatchingPipeline"]
