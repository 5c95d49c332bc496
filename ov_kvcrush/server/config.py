"""What a server serves: :class:`ServerConfig`, built from ``ov-kvcrush serve``'s flags or by a
library user, and what its app, backend and Ray replicas are made from (never the flags).

The method and budget are validated as ``ov-kvcrush generate`` validates them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from ov_kvcrush.config import CompressionConfig, parse_method_budget, parse_options
from ov_kvcrush.models.embedded import embedded_name
from ov_kvcrush.serving.chat import chat_method
from ov_kvcrush.validation import check_float, check_int


@dataclass(frozen=True)
class ServerConfig:
    """The server's model, compression, pool and limits; each field checked, named by its flag.

    Attributes:
        model: an exported IR directory (``None``: the embedded model).
        method, budget, sink_tokens, recent_tokens, options: the server's compression
            (``options``: ``KEY=VALUE`` method options); the method defaults as ``chat``'s.
        kv_pool_mib: the KV pool's size (``None``: unbounded).
        kv_precision: ``u8`` (the op's default on CPU), ``f16`` (on GPU) or ``f32``.
        device: ``CPU`` (our op), or ``GPU`` / ``GPU.N``: an Intel GPU through OpenVINO's GPU
            plugin with our layers (docs/intel_gpu.md).
        max_num_seqs, max_num_batched_tokens: the continuous-batching loop's step.
        max_queue: requests held at once (more get 429).
        max_methods: pipelines at once, one per method a request's ``kv_compression`` names.
        served_model_name: the model name clients send (``None``: the model's).
        port: the port served (part of the name a Ray replica's pipeline gets).
        threads: OpenVINO's inference threads (``None``: every core).
        cache_dir: where kept conversation caches are also written, to survive a restart
            (``None``: memory only; serving/persist.py).
        cache_dir_mib: the size budget of ``cache_dir``'s files (least recently used out).
        sparse_prefill: ``xattention``: our op's sparse prompt attention (``None``: dense).
    """

    model: str | None = None
    method: str | None = None
    budget: int | None = None
    sink_tokens: int | None = None
    recent_tokens: int | None = None
    options: tuple[str, ...] = ()
    kv_pool_mib: float | None = None
    kv_precision: str | None = None
    device: str = "CPU"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_queue: int = 64
    max_methods: int = 4
    served_model_name: str | None = None
    port: int = 8000
    threads: int | None = None
    cache_dir: str | None = None
    cache_dir_mib: float = 4096.0
    sparse_prefill: str | None = None

    def __post_init__(self) -> None:
        check_int("--max-queue", self.max_queue, 1, 1 << 16)
        check_int("--max-methods", self.max_methods, 1, 64)
        check_int("--port", self.port, 1, 65535)
        if self.threads is not None:
            check_int("--threads", self.threads, 1, 4096)
        if self.kv_pool_mib is not None:
            check_float("--kv-pool-mib", self.kv_pool_mib, 1.0, float(1 << 24))
        check_float("--cache-dir-mib", self.cache_dir_mib, 1.0, float(1 << 30))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """From ``ov-kvcrush serve``'s flags (their names are the fields')."""
        values = vars(args)
        config = {f.name: values[f.name] for f in fields(cls) if f.name != "options"}
        return cls(**config, options=tuple(args.option))

    def with_threads(self, threads: int) -> ServerConfig:
        """This config with ``threads`` where none are set (a Ray replica's CPU share)."""
        return self if self.threads is not None else type(self)(**{**self.to_dict(), "threads": threads})

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what a Ray replica is sent)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def compression(self) -> CompressionConfig:
        """The server's compression (a bad method, budget or option is named)."""
        return parse_method_budget(
            chat_method(self.method, self.budget), self.budget, sink_tokens=self.sink_tokens,
            recent_tokens=self.recent_tokens, options=parse_options(self.options),
        )  # fmt: skip

    def served_name(self) -> str:
        """The model name clients send: ``--served-model-name``, the embedded model's, or the folder's."""
        return (
            self.served_model_name or embedded_name(self.model) or os.path.basename(os.path.normpath(str(self.model)))
        )
