"""A server's backend from its :class:`~ov_kvcrush.server.config.ServerConfig`: the pipeline over
the model with its compression and pool, and the backend that makes the pipeline of another
method a request names the same way."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openvino_genai

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.op.kvcache import block_bytes, pool_blocks
from ov_kvcrush.server.backend import PipelineBackend
from ov_kvcrush.server.config import ServerConfig
from ov_kvcrush.serving.backends import make_engine, resolve_model
from ov_kvcrush.serving.persist import DiskCaches, identity_of
from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline


def build_backend(config: ServerConfig) -> PipelineBackend:
    """The server's pipeline (its method's), warmed up (the first request after a start, a
    returning conversation's from disk, is not the one that pays the runtime's first-use costs),
    and its backend."""
    pipeline = make_pipeline(config, config.compression())
    pipeline.warm_up()
    return PipelineBackend(
        pipeline, config.served_name(), config.max_queue,
        make_pipeline=lambda c: make_pipeline(config, c), max_methods=config.max_methods,
        disk=disk_caches(config),
    )  # fmt: skip


def disk_caches(config: ServerConfig) -> Callable[[ContinuousBatchingPipeline], DiskCaches] | None:
    """How a pipeline's conversation caches are kept on disk (``None``: without ``--cache-dir``):
    one subdirectory per pool configuration, so a file is only ever offered to the pool that can
    take it, and a file of another model or method is never read."""
    if config.cache_dir is None:
        return None
    budget = int(config.cache_dir_mib * 2**20)

    def make(pipeline: ContinuousBatchingPipeline) -> DiskCaches:
        identity = identity_of(pipeline.engine.model_dir, pipeline.pool)
        key = hashlib.sha256(json.dumps(identity["pool"], sort_keys=True).encode()).hexdigest()[:16]
        return DiskCaches(Path(config.cache_dir) / key, identity, budget)

    return make


def make_pipeline(config: ServerConfig, compression: CompressionConfig) -> ContinuousBatchingPipeline:
    """A pipeline over the model with ``compression``, its own pool of ``kv_pool_mib``."""
    sc = openvino_genai.SchedulerConfig()
    sc.max_num_seqs = config.max_num_seqs
    sc.max_num_batched_tokens = config.max_num_batched_tokens
    sc.dynamic_split_fuse = True
    options: dict[str, Any] = {} if config.kv_precision is None else {"kv_precision": config.kv_precision}
    if config.sparse_prefill is not None:
        options["sparse_prefill"] = config.sparse_prefill
    if config.threads is not None and config.device.upper() == "CPU":  # the CPU plugin's threads
        options["properties"] = {"INFERENCE_NUM_THREADS": config.threads}
    model = resolve_model("openvino", config.model)
    engine = make_engine("openvino", model, compression, device=config.device, **options)
    if config.kv_pool_mib is not None:
        one = block_bytes(engine.block_size, engine.shape.head_dim, engine.kv_precision)
        engine.max_kv_blocks = pool_blocks(int(config.kv_pool_mib * 2**20), one)
        engine.set_compression(engine.compression)  # the pool, with its limit
    return ContinuousBatchingPipeline(engine, sc)
