"""The OpenAI response bodies the server sends: a completion, its stream's chunks (server-sent
events), the usage (with the KV bytes held), and errors. Beside :mod:`~ov_kvcrush.server.protocol`,
which parses the requests; the app (:mod:`~ov_kvcrush.server.app`) only routes between them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse

from ov_kvcrush.server.backend import Answer
from ov_kvcrush.server.protocol import APIError


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


def completion_body(rid: str, chat: bool, model: str, answer: Answer) -> dict[str, Any]:
    """A whole (not streamed) completion of ``model``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": answer.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": answer.text}
    else:
        choice["text"] = answer.text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(answer),
    }


def chunk(
    rid: str,
    chat: bool,
    model: str,
    text: str | None,
    finish: str | None,
    extra: dict[str, Any] | None = None,
    role: bool = False,
) -> str:
    """One event of a stream: a piece of text, or the end (``finish``, with ``extra`` fields)."""
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
        "model": model,
        "choices": [choice],
        **(extra or {}),
    }
    return f"data: {json.dumps(data)}\n\n"


async def events(
    rid: str, chat: bool, model: str, first: str | Answer, rest: AsyncIterator[str | Answer]
) -> AsyncIterator[str]:
    """The stream's events: the role (chat), every piece, the end with its usage, ``[DONE]``; an
    error in flight as an OpenAI error event."""
    if chat:
        yield chunk(rid, chat, model, None, None, role=True)
    try:
        item: str | Answer | None = first
        while item is not None:
            if isinstance(item, Answer):
                yield chunk(rid, chat, model, None, item.finish_reason, {"usage": usage(item)})
                break
            yield chunk(rid, chat, model, item, None)
            item = await anext(rest, None)
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        await rest.aclose()
    yield "data: [DONE]\n\n"
