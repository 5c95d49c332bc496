"""The ASGI app (Starlette): OpenAI's ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` (streamed as server-sent events or not), ``/health``, ``/metrics``, and the
web chat page at ``/``.

Every error is an OpenAI-shaped JSON body with its status; a request without the API key (when
one is set) gets 401, and a body over the size limit is refused before it is parsed (413); a
full queue's 429 says when to retry (``Retry-After``). Every error response is counted in
``/metrics`` by its status, and every generation request leaves one access-log line (a JSON
object: path, status, tokens, finish, TTFT, KV bytes; or why it was refused) where the app is
given a log. The requests are parsed in :mod:`~ov_kvcrush.server.protocol`, the responses shaped
in :mod:`~ov_kvcrush.server.responses`: here they are only routed.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ov_kvcrush.server.backend import Answer, Backend
from ov_kvcrush.server.protocol import APIError, parse_generation, parse_json
from ov_kvcrush.server.responses import access_entry, completion_body, error_response, events

#: where the access-log lines go (``ov-kvcrush serve`` prints them, one JSON object a line)
AccessLog = Callable[[dict[str, Any]], None]

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB of JSON: ~250k tokens of text
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"


def check_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries ``api_key`` as its bearer token (none needed without one)."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)", kind="authentication_error")


async def read_body(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The JSON body, refused (413) past ``max_body_bytes`` before it is parsed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"the request body ({declared} bytes) exceeds {max_body_bytes} bytes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_body_bytes:
            raise APIError(413, f"the request body exceeds {max_body_bytes} bytes")
    return parse_json(bytes(body))


class Routes:
    """The app's endpoints over ``backend``."""

    def __init__(self, backend: Backend, api_key: str | None, max_body_bytes: int, log: AccessLog | None) -> None:
        self.backend = backend
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.log = log

    def logged(self, path: str, status: int, answer: Answer | None = None, error: str = "") -> None:
        """One request's access-log line (none without a log)."""
        if self.log is not None:
            self.log(access_entry(path, status, answer, error))

    async def models(self, request: Request) -> Response:
        check_key(request, self.api_key)
        card = {"id": self.backend.model_name, "object": "model", "created": 0, "owned_by": "ov_kvcrush"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def generate(self, request: Request, chat: bool) -> Response:
        check_key(request, self.api_key)
        req = parse_generation(await read_body(request, self.max_body_bytes), chat, max_tokens_default=256)
        model = self.backend.model_name
        if req.model and req.model != model:
            raise APIError(400, f"model {req.model!r} is not served here: allowed {model!r}", "model")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        replica = self.backend.replica_for(req)
        headers = {"x-ovkc-replica": replica} if replica else None
        path = request.url.path
        if req.stream:
            rest = self.backend.generate(req)
            first = await anext(rest)  # errors before the first token still get a status

            def ended(end: Answer | APIError | None) -> None:  # the stream's status was 200, whatever came
                if isinstance(end, APIError):
                    self.logged(path, 200, error=f"{end.status}: {end.message}")
                else:
                    self.logged(path, 200, end, "" if end is not None else "the client went away")

            stream = events(rid, chat, model, first, rest, req.include_usage, ended)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        answer = await self.backend.complete(req)
        self.logged(path, 200, answer)
        return JSONResponse(completion_body(rid, chat, model, answer), headers=headers)

    async def page(self, request: Request) -> Response:
        """The web chat page (static; it calls the API with the user's key, if one is set)."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "in_flight": self.backend.in_flight})

    async def pool(self, request: Request) -> Response:
        """The pool's state now (the page shows it beside each answer): requests running and
        waiting, blocks used and free (-1: unbounded), KV bytes held, conversations kept."""
        return JSONResponse(await asyncio.to_thread(self.backend.stats))  # a Ray backend asks its replicas

    async def metrics(self, request: Request) -> Response:
        # in a thread: the gauges may ask other processes (Ray replicas) and wait for them
        text = await asyncio.to_thread(self.backend.metrics.exposition)
        return Response(text, media_type="text/plain; version=0.0.4")

    def refused(self, request: Request, err: APIError) -> Response:
        """An error response: counted by its status, and logged where the request generates."""
        self.backend.metrics.error_response(err.status)
        if request.url.path.startswith("/v1/") and request.url.path != "/v1/models":
            self.logged(request.url.path, err.status, error=err.message)
        return error_response(err)


def make_app(
    backend: Backend,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    access_log: AccessLog | None = None,
) -> Starlette:
    """The server's app over ``backend``: its routes (``access_log``: where each generation
    request's line goes; None: nowhere)."""
    r = Routes(backend, api_key, max_body_bytes, access_log)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return r.refused(request, exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # an unknown path, a wrong method
        return r.refused(request, APIError(exc.status_code, str(exc.detail)))

    routes = [
        Route("/", r.page, methods=["GET"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/v1/chat/completions", r.chat, methods=["POST"]),
        Route("/v1/completions", r.completions, methods=["POST"]),
        Route("/health", r.health, methods=["GET"]),
        Route("/metrics", r.metrics, methods=["GET"]),
        Route("/pool", r.pool, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error})
