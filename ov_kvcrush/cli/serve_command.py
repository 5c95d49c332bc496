"""``ov-kvcrush serve``: the OpenAI-compatible server (:mod:`ov_kvcrush.server`) over one
continuous-batching pipeline of backend openvino, on uvicorn.

Its flags are parsed here (``--help`` imports nothing heavy); the method and budget are
validated as ``ov-kvcrush generate`` validates them. It binds to 127.0.0.1 unless told otherwise;
``--api-key`` (or ``OV_KVCRUSH_API_KEY``) makes every request need ``Authorization: Bearer <key>``.
SIGTERM and Ctrl-C stop accepting connections, let the requests in flight finish, then exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ov_kvcrush.validation import check_int

# Imported where used, inside functions: what pulls in numpy, openvino_genai, platformdirs,
# prometheus_client, ray, starlette, torch, uvicorn, heavy to import, so that importing this module
# stays light.

API_KEY_ENV = "OV_KVCRUSH_API_KEY"


def add_serve_arguments(sub: Any) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching on our op)")
    s.add_argument("--model", help="an exported IR directory (default: the embedded smollm2-135m; or gemma3-270m)")
    s.add_argument(
        "--method",
        default=None,
        help="the server's compression method (default: full; kvzip with only --budget, as chat)",
    )
    s.add_argument("--budget", type=int, help="KV tokens kept per layer and KV head")
    s.add_argument("--sink-tokens", type=int, default=None)
    s.add_argument("--recent-tokens", type=int, default=None)
    s.add_argument("--option", action="append", default=[], help="method option key=value (repeatable)")
    s.add_argument("--kv-pool-mib", type=float, default=None, help="the KV pool's size in MiB (default: unbounded)")
    s.add_argument("--kv-precision", default=None, help="u8 (default on CPU, as native), f16 (default on GPU) or f32")
    s.add_argument(
        "--sparse-prefill",
        default=None,
        help="xattention: prompts attend only the key blocks XAttention's estimate keeps (device CPU; off by "
        "default: it can lose needles, docs/library.md)",
    )
    s.add_argument(
        "--device", default="CPU", help="CPU (our op), or GPU / GPU.N: an Intel GPU through OpenVINO's GPU plugin"
    )
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (default 16)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step (default 2048)")
    s.add_argument("--max-queue", type=int, default=64, help="requests held at once; more get 429 (default 64)")
    s.add_argument(
        "--max-methods", type=int, default=4, help="methods at once: a request's kv_compression gets a pipeline (4)"
    )
    s.add_argument("--max-body-kib", type=int, default=1024, help="largest request body accepted (default 1024)")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: the folder's)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help=f"require this bearer token (or set {API_KEY_ENV})")
    s.add_argument("--threads", type=int, default=None, help="OpenVINO inference threads (default: every core)")
    s.add_argument(
        "--cache-dir", default=None, help="also keep conversation caches here, to continue them after a restart"
    )
    s.add_argument(
        "--cache-dir-mib", type=float, default=4096.0, help="size budget of --cache-dir, least recently used out"
    )
    s.add_argument(
        "--quiet", action="store_true",
        help="no access log (default: one JSON line a request on stderr: status, tokens, TTFT, KV bytes)",
    )  # fmt: skip
    r = s.add_argument_group("scale-out on Ray Serve (pip install 'ov_kvcrush[serve]')")
    r.add_argument("--ray", action="store_true", help="serve from --replicas Ray Serve replicas, one pool each")
    r.add_argument("--replicas", type=int, default=2, help="replicas (default 2); a conversation stays on one")
    r.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica takes (and its threads)")
    r.add_argument("--ray-address", default=None, help="an existing cluster (e.g. auto); default: a local one")


def print_access(entry: dict) -> None:
    """An access-log line: the request's entry as one JSON object on stderr, with its time."""
    print(json.dumps({"time": round(time.time(), 3), **entry}), file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn  # the server's modules: not for --help

    from ov_kvcrush.server.app import make_app
    from ov_kvcrush.server.config import ServerConfig

    check_int("--max-body-kib", args.max_body_kib, 1, 1 << 20)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = ServerConfig.from_args(args)
    if args.ray:
        from ov_kvcrush.server.ray_serve import deploy  # Ray: only with --ray

        backend = deploy(config, args.replicas, args.cpus_per_replica, args.ray_address)
    else:
        from ov_kvcrush.server.factory import build_backend  # openvino: not for --help

        backend = build_backend(config)
    app = make_app(backend, api_key=api_key, max_body_bytes=args.max_body_kib * 1024,
                   access_log=None if args.quiet else print_access)  # fmt: skip
    http = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=300)
    try:
        sock = http.bind_socket()  # bound only: uvicorn listens when its server starts
        sock.listen(http.backlog)  # listening before the line below: a client that waits for it connects
        print(f"serving {backend.model_name} on http://{args.host}:{args.port}/v1", flush=True)
        uvicorn.Server(http).run(sockets=[sock])
    finally:
        backend.close()
    return 0
