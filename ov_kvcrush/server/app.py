"""The ASGI app (Starlette): OpenAI's ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` (streamed as server-sent events or not), ``/health``, ``/metrics``, and the
web chat page at ``/``.

Every error is an OpenAI-shaped JSON body with its status; a request without the API key (when
one is set) gets 401, and a body over the size limit is refused before it is parsed (413).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ov_kvcrush.server.backend import Answer, Backend
from ov_kvcrush.server.protocol import APIError, GenerationRequest, parse_generation, parse_json

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB of JSON: ~250k tokens of text
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def usage(answer: Answer) -> dict[str, Any]:
    r = answer.result
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.generated_tokens,
        "total_tokens": r.prompt_tokens + r.generated_tokens,
        # prompt tokens continued from the conversation's kept cache instead of prefilled
        "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
        # what the request's KV cache held at its end against the full cache's bytes
        "kv_bytes": r.kv_bytes,
        "full_kv_bytes": r.full_kv_bytes,
        "peak_kv_bytes": r.peak_kv_bytes,
        "ttft_ms": round(r.ttft_ms, 3),
        "tpot_ms": round(r.tpot_ms, 3),
    }


def make_app(backend: Backend, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY) -> Starlette:
    """The server's app over ``backend``."""

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401, "a valid API key is required (Authorization: Bearer <key>)", kind="authentication_error"
            )

    async def read_body(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"the request body ({declared} bytes) exceeds {max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"the request body exceeds {max_body_bytes} bytes")
        return parse_json(bytes(body))

    def check_model(req: GenerationRequest) -> None:
        if req.model and req.model != backend.model_name:
            raise APIError(400, f"model {req.model!r} is not served here: allowed {backend.model_name!r}", "model")

    async def models(request: Request) -> Response:
        check_key(request)
        card = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "ov_kvcrush"}
        return JSONResponse({"object": "list", "data": [card]})

    def endpoint(chat: bool):
        async def handle(request: Request) -> Response:
            check_key(request)
            req = parse_generation(await read_body(request), chat, max_tokens_default=256)
            check_model(req)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            replica = backend.replica_for(req)
            headers = {"x-ovkc-replica": replica} if replica else None
            if req.stream:
                events = backend.generate(req)
                first = await anext(events)  # errors before the first token still get a status
                stream = sse(rid, chat, req, first, events)
                return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
            answer = await backend.complete(req)
            return JSONResponse(body(rid, chat, answer), headers=headers)

        return handle

    def body(rid: str, chat: bool, answer: Answer) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": answer.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": backend.model_name,
            "choices": [choice],
            "usage": usage(answer),
        }

    def chunk(
        rid: str,
        chat: bool,
        text: str | None,
        finish: str | None,
        extra: dict[str, Any] | None = None,
        role: bool = False,
    ) -> str:
        if chat:
            delta: dict[str, str] = {} if text is None else {"content": text}
            if role:  # the first chat chunk names the assistant's role, as OpenAI's streams start
                delta = {"role": "assistant", "content": ""}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        data = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": backend.model_name,
            "choices": [choice],
            **(extra or {}),
        }
        return f"data: {json.dumps(data)}\n\n"

    async def sse(
        rid: str, chat: bool, req: GenerationRequest, first: str | Answer, events: AsyncIterator[str | Answer]
    ) -> AsyncIterator[str]:
        if chat:
            yield chunk(rid, chat, None, None, role=True)
        try:
            item: str | Answer | None = first
            while item is not None:
                if isinstance(item, Answer):
                    yield chunk(rid, chat, None, item.finish_reason, {"usage": usage(item)})
                    break
                yield chunk(rid, chat, item, None)
                item = await anext(events, None)
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    async def page(request: Request) -> Response:
        """The web chat page (static; it calls the API with the user's key, if one is set)."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "in_flight": backend.in_flight})

    async def metrics(request: Request) -> Response:
        # in a thread: the gauges may ask other processes (Ray replicas) and wait for them
        text = await asyncio.to_thread(backend.metrics.exposition)
        return Response(text, media_type="text/plain; version=0.0.4")

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # an unknown path, a wrong method
        return error_response(APIError(exc.status_code, str(exc.detail)))

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"]),
        Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error})
