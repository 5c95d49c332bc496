"""``ov-kvcrush serve``: the OpenAI-compatible server (:mod:`ov_kvcrush.server`) over one
continuous-batching pipeline of backend openvino, on uvicorn.

Its flags are parsed here (``--help`` imports nothing heavy); the method and budget are
validated as ``ov-kvcrush generate`` validates them. It binds to 127.0.0.1 unless told otherwise;
``--api-key`` (or ``OV_KVCRUSH_API_KEY``) makes every request need ``Authorization: Bearer <key>``.
SIGTERM and Ctrl-C stop accepting connections, let the requests in flight finish, then exit.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

API_KEY_ENV = "OV_KVCRUSH_API_KEY"


def add_serve_arguments(sub: Any) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching on our op)")
    s.add_argument("--model", help="an exported IR directory (default: the embedded smollm2-135m; or gemma3-270m)")
    s.add_argument("--method", default="full", help="the server's compression method (default: full)")
    s.add_argument("--budget", type=int, help="KV tokens kept per layer and KV head")
    s.add_argument("--sink-tokens", type=int, default=None)
    s.add_argument("--recent-tokens", type=int, default=None)
    s.add_argument("--option", action="append", default=[], help="method option key=value (repeatable)")
    s.add_argument("--kv-pool-mib", type=float, default=None, help="the KV pool's size in MiB (default: unbounded)")
    s.add_argument("--kv-precision", default=None, help="u8 (default, as native), f16 or f32")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (default 16)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step (default 2048)")
    s.add_argument("--max-queue", type=int, default=64, help="requests held at once; more get 429 (default 64)")
    s.add_argument("--max-body-kib", type=int, default=1024, help="largest request body accepted (default 1024)")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: the folder's)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help=f"require this bearer token (or set {API_KEY_ENV})")


def build_backend(args: argparse.Namespace) -> Any:
    """The pipeline and its server backend from the command's flags."""
    import openvino_genai

    from ov_kvcrush.config import parse_method_budget, parse_options
    from ov_kvcrush.engines.backends import resolve_model
    from ov_kvcrush.engines.openvino_engine import OpenVINOEngine
    from ov_kvcrush.models.embedded import embedded_name
    from ov_kvcrush.op.kvcache import block_bytes, pool_blocks
    from ov_kvcrush.server.backend import Backend
    from ov_kvcrush.serving.pipeline import ContinuousBatchingPipeline
    from ov_kvcrush.validation import check_float, check_int

    check_int("--max-queue", args.max_queue, 1, 1 << 16)
    check_int("--port", args.port, 1, 65535)
    compression = parse_method_budget(
        args.method, args.budget, sink_tokens=args.sink_tokens, recent_tokens=args.recent_tokens,
        options=parse_options(args.option),
    )  # fmt: skip
    sc = openvino_genai.SchedulerConfig()
    sc.max_num_seqs = args.max_num_seqs
    sc.max_num_batched_tokens = args.max_num_batched_tokens
    sc.dynamic_split_fuse = True
    options: dict[str, Any] = {} if args.kv_precision is None else {"kv_precision": args.kv_precision}
    engine = OpenVINOEngine(resolve_model("openvino", args.model), compression, **options)
    if args.kv_pool_mib is not None:
        check_float("--kv-pool-mib", args.kv_pool_mib, 1.0, float(1 << 24))
        one = block_bytes(engine.block_size, engine.shape.head_dim, engine.kv_precision)
        engine.max_kv_blocks = pool_blocks(int(args.kv_pool_mib * 2**20), one)
        engine.set_compression(engine.compression)  # the pool, with its limit
    pipeline = ContinuousBatchingPipeline(engine, sc)
    name = args.served_model_name or embedded_name(args.model) or os.path.basename(os.path.normpath(str(args.model)))
    return Backend(pipeline, name, args.max_queue)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ov_kvcrush.server.app import make_app
    from ov_kvcrush.validation import check_int

    check_int("--max-body-kib", args.max_body_kib, 1, 1 << 20)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    backend = build_backend(args)
    app = make_app(backend, api_key=api_key, max_body_bytes=args.max_body_kib * 1024)
    print(f"serving {backend.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=300)
    return 0
