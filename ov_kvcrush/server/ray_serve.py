"""Scale-out on Ray Serve: ``ov-kvcrush serve --ray --replicas N``.

Each replica is a Ray Serve deployment of its own (one replica each) that builds the same
pipeline and pool as ``ov-kvcrush serve`` does (:class:`~ov_kvcrush.server.backend.PipelineBackend`),
its OpenVINO threads set to its CPU share. The HTTP server stays ours (the same app, validation
and errors) in the process that deploys them; its backend sends each request to one replica
through a deployment handle and streams the replica's pieces back.

Session affinity: a conversation's turns share their first messages, so the conversation key is
a hash of them (of the prompt's start, for completions), and key modulo N picks the replica:
every turn goes to the replica that holds the conversation's kept cache. (Ray Serve's model
multiplexing routes by a key too, but only prefers replicas that have it: two turns can land on
two replicas.) Growing past one machine: ``ray start --head`` on one, ``ray start --address
<head>:6379`` on the others (or a KubeRay ``RayCluster``), then ``ov-kvcrush serve --ray
--ray-address auto --replicas N``: the replicas are placed by their CPU share across the nodes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from ov_kvcrush.server.backend import Answer, Backend
from ov_kvcrush.server.config import ServerConfig
from ov_kvcrush.server.factory import build_backend
from ov_kvcrush.server.protocol import APIError, GenerationRequest
from ov_kvcrush.validation import check_float, check_int

#: of a completion's prompt, how many leading characters name its conversation
PROMPT_KEY_CHARS = 2000


def conversation_key(req: GenerationRequest) -> str:
    """What every turn of one conversation shares: its messages up to and including the first
    user message (a chat), or the prompt's first characters (a completion)."""
    if isinstance(req.prompt, str):
        head: Any = req.prompt[:PROMPT_KEY_CHARS]
    else:
        first_user = next((i for i, m in enumerate(req.prompt) if m["role"] == "user"), len(req.prompt) - 1)
        head = req.prompt[: first_user + 1]
    return hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()


@serve.deployment(max_ongoing_requests=1024)
class Replica:
    """One pipeline and pool on a Ray worker, serving what the ingress routes to it."""

    def __init__(self, options: dict[str, Any], name: str) -> None:
        self.name = name
        self.backend = build_backend(ServerConfig(**options))

    async def stream(self, req: GenerationRequest) -> AsyncIterator[str | Answer | APIError]:
        """The request's pieces and answer; an :class:`APIError` as the last item (it crosses
        whole, and the ingress raises it)."""
        try:
            async for item in self.backend.stream(req):
                yield item
        except APIError as e:
            yield e

    def stats(self) -> dict[str, int]:
        return self.backend.stats()

    def model_name(self) -> str:
        return self.backend.model_name


class RayBackend(Backend):
    """The ingress's backend: each conversation on one replica, its pieces streamed back."""

    def __init__(
        self, handles: list[Any], names: list[str], model_name: str, max_queue: int, owns_ray: bool = False
    ) -> None:
        super().__init__(model_name, max_queue)
        self.handles = handles
        self.names = names
        self.owns_ray = owns_ray  # it started the local cluster: it stops it

    def _index(self, req: GenerationRequest) -> int:
        return int(conversation_key(req), 16) % len(self.handles)

    def replica_for(self, req: GenerationRequest) -> str | None:
        return self.names[self._index(req)]

    async def stream(self, req: GenerationRequest) -> AsyncIterator[str | Answer]:
        items = self.handles[self._index(req)].options(stream=True).stream.remote(req)
        try:
            async for item in items:
                if isinstance(item, APIError):
                    raise item
                yield item
        finally:
            items.cancel()  # a client gone mid-stream: the replica cancels its request

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for handle in self.handles:
            for key, value in handle.stats.remote().result().items():
                total[key] = (
                    -1 if -1 in (value, total.get(key, 0)) and key == "blocks_free" else total.get(key, 0) + value
                )
        return total

    def close(self) -> None:
        serve.shutdown()
        if self.owns_ray:
            ray.shutdown()


def deploy(config: ServerConfig, replicas: int, cpus_per_replica: float, address: str | None = None) -> RayBackend:
    """Start Ray (a local cluster on 127.0.0.1, or ``address``'s), deploy ``replicas`` replicas of
    ``cpus_per_replica`` CPUs each, and return the ingress's backend."""
    check_int("--replicas", replicas, 1, 1024)
    check_float("--cpus-per-replica", cpus_per_replica, 0.1, 1024.0)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(proxy_location="Disabled")  # the HTTP server is ours
    options = config.with_threads(max(1, int(cpus_per_replica))).to_dict()  # threads follow the CPU share
    handles, names = [], []
    for i in range(replicas):
        name = f"ovkc-replica-{i}"
        app = Replica.options(name=name, num_replicas=1, ray_actor_options={"num_cpus": cpus_per_replica})
        handles.append(serve.run(app.bind(options, name), name=name, route_prefix=None))
        names.append(name)
    return RayBackend(handles, names, config.served_name(), config.max_queue, owns_ray)
