"""The OpenAI request bodies the server accepts, validated into plain dataclasses, and its errors
as OpenAI-shaped bodies (``{"error": {"message", "type", "param", "code"}}``).

Every field is checked by name with its allowed range, as the CLI checks its flags; a field the
server cannot honour (``n > 1``, ``logprobs``, tools) is refused by name rather than ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ov_kvcrush.config import CompressionConfig, GenerationSettings, parse_method_budget
from ov_kvcrush.errors import ConfigError, UserError

# Imported where used, inside functions: what pulls in numpy, torch, heavy to import, so that
# importing this module stays light.

#: fields the server refuses when set to anything but their neutral values (null, an empty list
#: and these: what ordinary clients send by default)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": (),
    "tools": (),
    "tool_choice": ("none",),
    "functions": (),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
}
#: fields accepted and without effect on the answer (OpenAI clients send them)
IGNORED = {"user", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls"}
#: the sampling fields, beside OpenAI's: the name a client sends -> GenerationSettings' field, and its range
SAMPLING_FIELDS = {
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0),
    "presence_penalty": ("presence_penalty", -2.0, 2.0),
    "repetition_penalty": ("repetition_penalty", 0.01, 10.0),  # vLLM's
    "min_p": ("min_p", 0.0, 1.0),  # vLLM's
}
#: a chat message's roles (``developer``: OpenAI's newer name for ``system``, sent as it)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error the server answers with ``status`` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def __reduce__(self) -> tuple[Any, ...]:  # crosses processes whole (a Ray replica's error)
        return (APIError, (self.status, self.message, self.param, self.kind))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class GenerationRequest:
    """One validated request: what to generate from, how, and how to answer (``compression``:
    the request's own method, ``None``: the server's)."""

    chat: bool
    prompt: str | list[dict[str, str]]
    settings: GenerationSettings
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    model: str = ""
    include_usage: bool = False
    compression: CompressionConfig | None = None
    #: a stop string ends the answer after it (vLLM's ``include_stop_str_in_output``), not before
    include_stop: bool = False
    #: the name the client gave the token limit (``max_tokens`` or ``max_completion_tokens``)
    max_tokens_param: str = "max_tokens"


#: the fields of the ``kv_compression`` extension (``ov-kvcrush serve``'s flags of the same names)
COMPRESSION_FIELDS = ("method", "budget", "sink_tokens", "recent_tokens", "options")


def parse_compression(value: Any) -> CompressionConfig | None:
    """The ``kv_compression`` extension field, validated as the CLI validates ``--method``,
    ``--budget``, ``--sink-tokens``, ``--recent-tokens`` and ``--option``. Whether the server's
    engine runs it on its device is the engine's to say (:meth:`PipelineBackend.pipeline_for`)."""
    if value is None:
        return None
    allowed = "an object {" + ", ".join(COMPRESSION_FIELDS) + "} with at least a method"
    if not isinstance(value, dict) or "method" not in value or set(value) - set(COMPRESSION_FIELDS):
        raise APIError(400, f"kv_compression={json.dumps(value)} is invalid: allowed {allowed}", "kv_compression")
    options = value.get("options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "kv_compression.options must be an object of method fields", "kv_compression.options")
    try:
        return parse_method_budget(
            value["method"], value.get("budget"), sink_tokens=value.get("sink_tokens"),
            recent_tokens=value.get("recent_tokens"), options={k: _tuples(v) for k, v in options.items()},
        )  # fmt: skip
    except UserError as e:
        raise compression_error(e, options) from e


def compression_error(e: UserError, options: dict[str, Any]) -> APIError:
    """A 400 for a compression refused with ``e``, its ``param`` the client's field: one of
    ``kv_compression``'s own (``kv_compression.method``), one of its ``options``
    (``kv_compression.options.window``), else the object."""
    field_name = e.field.split(".")[-1] if isinstance(e, ConfigError) else ""
    if field_name in COMPRESSION_FIELDS:
        param = f"kv_compression.{field_name}"
    elif field_name and field_name in options:
        param = f"kv_compression.options.{field_name}"
    else:
        param = "kv_compression"
    return APIError(400, f"kv_compression: {e}", param)


def _tuples(v: Any) -> Any:
    """JSON lists as the tuples method fields take (as ``--option``'s values)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _number(body: dict[str, Any], name: str, default: Any, lo: float, hi: float) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise APIError(400, f"{name}={value!r} is invalid: allowed a number in [{lo}, {hi}]", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: Any, lo: int, hi: int) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise APIError(400, f"{name}={value!r} is invalid: allowed an integer in [{lo}, {hi}]", name)
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != [] and not any(value == n and type(value) is type(n) for n in neutral):
            raise APIError(400, f"{name}={value!r} is not supported by this server", name)
    known = {
        "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
        "stop", "stream", "ignore_eos", "kv_compression", "top_k", "min_tokens", "include_stop_str_in_output",
        *SAMPLING_FIELDS, *UNSUPPORTED, *IGNORED,
    }  # fmt: skip
    for name in body:
        if name not in known:
            raise APIError(400, f"unknown field {name!r}", name)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if isinstance(content, list):  # content parts: text only
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(p for p in parts if isinstance(p, str)) if len(parts) == len(content) else None
        if role not in ROLES or not isinstance(content, str):
            raise APIError(
                400, f"messages[{i}] must have a role ({', '.join(ROLES)}) and text content", f"messages[{i}]"
            )
        out.append({"role": ROLES[role], "content": content})
    return out


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}", "stop")
    return stops


def parse_generation(body: dict[str, Any], chat: bool, max_tokens_default: int) -> GenerationRequest:
    """A chat (``messages``) or completion (``prompt``) body as a :class:`GenerationRequest`."""
    _refuse_unsupported(body)
    if chat:
        prompt: str | list[dict[str, str]] = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, "prompt must be a non-empty string (one prompt per request)", "prompt")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, name, max_tokens_default, 1, 1 << 16)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    seed = _integer(body, "seed", None, 0, 2**31 - 1)  # none: fresh randomness each request
    top_k = _integer(body, "top_k", 0, -1, 1 << 20)  # vLLM's: -1 or 0 for every token
    sampling = {ours: _number(body, name, None, lo, hi) for name, (ours, lo, hi) in SAMPLING_FIELDS.items()}
    min_tokens = _integer(body, "min_tokens", 0, 0, max_tokens)
    include_stop = body.get("include_stop_str_in_output", False)
    if not isinstance(include_stop, bool):
        raise APIError(400, f"include_stop_str_in_output={include_stop!r} is invalid: allowed true or false",
                       "include_stop_str_in_output")  # fmt: skip
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream={stream!r} is invalid: allowed true or false", "stream")
    options = body.get("stream_options") or {}
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: generate max_tokens (benchmarks)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, f"ignore_eos={ignore_eos!r} is invalid: allowed true or false", "ignore_eos")
    try:
        settings = GenerationSettings(
            max_new_tokens=max_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=top_p if top_p > 0 else 1.0,
            top_k=max(top_k, 0),
            seed=seed,
            apply_chat_template=chat,
            ignore_eos=ignore_eos,
            min_new_tokens=min_tokens,
            **{k: v for k, v in sampling.items() if v is not None},
        )
    except UserError as e:
        raise APIError(400, str(e)) from e
    model = body.get("model", "")
    return GenerationRequest(
        chat=chat,
        prompt=prompt,
        settings=settings,
        stream=stream,
        stop=_stop(body.get("stop")),
        model=model if isinstance(model, str) else "",
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        compression=parse_compression(body.get("kv_compression")),
        include_stop=include_stop,
        max_tokens_param=name,
    )
