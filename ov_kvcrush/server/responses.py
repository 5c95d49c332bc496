"""The OpenAI response bodies the server sends: a completion, its stream's chunks (server-sent
events), the usage (with the KV bytes held), and errors. Beside :mod:`~ov_kvcrush.server.protocol`,
which parses the requests; the app (:mod:`~ov_kvcrush.server.app`) only routes between them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import JSONResponse

from ov_kvcrush.server.backend import Answer
from ov_kvcrush.server.protocol import APIError

#: seconds a client is asked to wait before retrying a full queue (429): requests end in seconds
RETRY_AFTER_S = 1


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def access_entry(path: str, status: int, answer: Answer | None = None, error: str = "") -> dict[str, Any]:
    """One request's access-log line: its path and status, and (answered) its :func:`usage`
    (tokens, KV bytes against the full cache's, TTFT, TPOT) flat, and its finish; (refused) why."""
    entry: dict[str, Any] = {"path": path, "status": status}
    if answer is not None:
        fields = usage(answer)
        details = fields.pop("prompt_tokens_details")
        entry |= fields | {"cached_tokens": details["cached_tokens"], "finish_reason": answer.finish_reason}
    if error:
        entry["error"] = error
    return entry


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
    """One event of a stream: a piece of text, or the end (``finish``), with ``extra`` fields
    (``usage: null`` where the client asked for the usage at the end)."""
    if chat:
        delta: dict[str, str] = {} if text is None else {"content": text}
        if role:  # the first chat chunk names the assistant's role, as OpenAI's streams start
            delta = {"role": "assistant", "content": ""}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return _event(rid, chat, model, [choice], extra)


def _event(rid: str, chat: bool, model: str, choices: list[dict[str, Any]], extra: dict[str, Any] | None) -> str:
    data = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **(extra or {}),
    }
    return f"data: {json.dumps(data)}\n\n"


async def events(
    rid: str,
    chat: bool,
    model: str,
    first: str | Answer,
    rest: AsyncIterator[str | Answer],
    include_usage: bool,
    ended: Callable[[Answer | APIError | None], None],
) -> AsyncIterator[str]:
    """The stream's events: the role (chat), every piece, the end, then (``include_usage``:
    ``stream_options.include_usage``) OpenAI's last chunk, no choices and the usage, every
    chunk before it with ``usage: null``; ``[DONE]``. An error in flight as an OpenAI error event.
    ``ended``: called once with the answer, the error, or None (the client went away first)."""
    end: Answer | APIError | None = None
    extra = {"usage": None} if include_usage else None
    if chat:
        yield chunk(rid, chat, model, None, None, extra, role=True)
    try:
        item: str | Answer | None = first
        while item is not None:
            if isinstance(item, Answer):
                end = item
                yield chunk(rid, chat, model, None, item.finish_reason, extra)
                if include_usage:
                    yield _event(rid, chat, model, [], {"usage": usage(item)})
                break
            yield chunk(rid, chat, model, item, None, extra)
            item = await anext(rest, None)
    except APIError as e:
        end = e
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        ended(end)
        await rest.aclose()
    yield "data: [DONE]\n\n"
