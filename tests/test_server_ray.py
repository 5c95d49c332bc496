"""Scale-out on Ray Serve (issue 50, item 4): ``ov-kvcrush serve --ray --replicas 2`` on a local
cluster bound to 127.0.0.1. Both replicas answer, each answer is the pipeline's own, and a
conversation's second turn lands on the replica of its first (its kept cache is found there).
Skips, saying so, where ``ray`` is not installed (``pip install 'ov_kvcrush[serve]'``).
"""

from __future__ import annotations

import httpx
import pytest

from ov_kvcrush.cli.main import build_parser
from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.server.app import make_app
from ov_kvcrush.server.thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.slow]

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ov_kvcrush[serve]')")

SERVE = ["serve", "--ray", "--replicas", "2", "--cpus-per-replica", "1"]


@pytest.fixture(scope="module")
def ray_server(model_dir):
    from ov_kvcrush.server.config import ServerConfig
    from ov_kvcrush.server.ray_serve import deploy

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        args = build_parser().parse_args([*SERVE, "--model", str(model_dir)])
        backend = deploy(ServerConfig.from_args(args), args.replicas, args.cpus_per_replica)
        try:
            with ServerThread(make_app(backend)) as server:
                yield server
        finally:
            backend.close()
    finally:
        ray.shutdown()


def chat(server, messages):
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.headers["x-ovkc-replica"], r.json()


def test_both_replicas_answer_and_a_conversation_stays_on_its_replica(ray_server, model_dir):
    from ov_kvcrush.server.config import ServerConfig
    from ov_kvcrush.server.factory import build_backend

    local = build_backend(ServerConfig(model=str(model_dir)))
    seen: dict[str, list[dict[str, str]]] = {}
    for i in range(16):  # conversations until each replica has one
        first = [{"role": "user", "content": f"My name is Ada{i}. The lighthouse keeper writes letters. " * 8}]
        replica, body = chat(ray_server, first)
        want = local.pipeline.generate([first], GenerationSettings(max_new_tokens=12))[0].text
        assert body["choices"][0]["message"]["content"] == want  # the replica's pipeline answers as ours
        seen.setdefault(replica, [*first, {"role": "assistant", "content": want}])
        if len(seen) == 2:
            break
    assert sorted(seen) == ["ovkc-replica-0", "ovkc-replica-1"]
    for replica, history in seen.items():
        again, body = chat(ray_server, [*history, {"role": "user", "content": "What is my name?"}])
        assert again == replica
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its kept cache was there
    metrics = httpx.get(f"{ray_server.url}/metrics").text
    assert "ovkc_kept_caches" in metrics
