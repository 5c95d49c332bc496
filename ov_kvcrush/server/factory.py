"""A server's backend from ``ov-kvcrush serve``'s flags (an ``argparse.Namespace``, or the same
values a Ray replica gets as a dict): the pipeline over the model, its compression and pool.

The method and budget are validated as ``ov-kvcrush generate`` validates them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """What :func:`build_backend` reads of the flags, as plain values (a Ray replica gets them)."""
    keys = ("model", "method", "budget", "sink_tokens", "recent_tokens", "option", "kv_pool_mib", "kv_precision",
            "max_num_seqs", "max_num_batched_tokens", "max_queue", "max_methods", "served_model_name", "port",
            "threads")  # fmt: skip
    values = vars(args)
    return {k: values[k] for k in keys}


def build_backend(args: argparse.Namespace) -> Any:
    """The server's pipeline (its method's) and its backend, which makes the pipeline of another
    method a request names the same way."""
    from ov_kvcrush.config import parse_method_budget, parse_options
    from ov_kvcrush.server.backend import PipelineBackend
    from ov_kvcrush.serving.chat import chat_method
    from ov_kvcrush.validation import check_int

    check_int("--max-queue", args.max_queue, 1, 1 << 16)
    check_int("--max-methods", args.max_methods, 1, 64)
    check_int("--port", args.port, 1, 65535)
    method = chat_method(args.method, args.budget)
    compression = parse_method_budget(
        method, args.budget, sink_tokens=args.sink_tokens, recent_tokens=args.recent_tokens,
        options=parse_options(args.option),
    )  # fmt: skip
    return PipelineBackend(
        make_pipeline(args, compression), served_name(args), args.max_queue,
        make_pipeline=lambda c: make_pipeline(args, c), max_methods=args.max_methods,
    )  # fmt: skip


def make_pipeline(args: argparse.Namespace, compression: Any) -> Any:
    """A pipeline over the model with ``compression``, its own pool of ``--kv-pool-mib``."""
    import openvino_genai

    from ov_kvcrush.engines.backends import resolve_model
    from ov_kvcrush.engines.openvino_engine import OpenVINOEngine
    from ov_kvcrush.op.kvcache import block_bytes, pool_blocks
    from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline
    from ov_kvcrush.validation import check_float, check_int

    sc = openvino_genai.SchedulerConfig()
    sc.max_num_seqs = args.max_num_seqs
    sc.max_num_batched_tokens = args.max_num_batched_tokens
    sc.dynamic_split_fuse = True
    options: dict[str, Any] = {} if args.kv_precision is None else {"kv_precision": args.kv_precision}
    if args.threads is not None:
        check_int("--threads", args.threads, 1, 4096)
        options["properties"] = {"INFERENCE_NUM_THREADS": args.threads}
    engine = OpenVINOEngine(resolve_model("openvino", args.model), compression, **options)
    if args.kv_pool_mib is not None:
        check_float("--kv-pool-mib", args.kv_pool_mib, 1.0, float(1 << 24))
        one = block_bytes(engine.block_size, engine.shape.head_dim, engine.kv_precision)
        engine.max_kv_blocks = pool_blocks(int(args.kv_pool_mib * 2**20), one)
        engine.set_compression(engine.compression)  # the pool, with its limit
    return ContinuousBatchingPipeline(engine, sc)


def served_name(args: argparse.Namespace) -> str:
    """The model name clients send: ``--served-model-name``, the embedded model's, or the folder's."""
    from ov_kvcrush.models.embedded import embedded_name

    return args.served_model_name or embedded_name(args.model) or os.path.basename(os.path.normpath(str(args.model)))
