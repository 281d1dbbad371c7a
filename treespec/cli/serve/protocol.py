"""The OpenAI request bodies this server takes, checked field by field.

``parse_request(body, kind)`` turns the raw JSON of ``POST /v1/completions`` (kind
"completion") or ``POST /v1/chat/completions`` (kind "chat") into a ``CompletionRequest``, or
raises ``ApiError`` (HTTP 400) naming the field: malformed JSON, an unknown field, a wrong type,
a value out of range, ``n`` other than 1. Nothing here touches a model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

Kind = Literal["completion", "chat"]

MAX_STOP = 4            # stop strings per request (OpenAI's limit)
ROLES = ("system", "user", "assistant")

# field -> what it must be (shown in errors); the fields each endpoint takes, nothing else.
COMMON = {
    "model": "a string (the served model's id, /v1/models)",
    "max_tokens": "an integer >= 1",
    "temperature": "a number in [0, 2]",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer >= 0 (0: off)",
    "min_p": "a number in [0, 1]",
    "seed": "an integer (a seeded sampled request repeats its text)",
    "stop": "a string or a list of at most 4 non-empty strings",
    "n": "1 (one completion per request)",
    "stream": "true or false",
    "stream_options": 'an object {"include_usage": true or false}',
    "user": "a string",
}
FIELDS: dict[Kind, dict[str, str]] = {
    "completion": {"prompt": "a non-empty string or a non-empty list of token ids", **COMMON},
    "chat": {"messages": 'a non-empty list of {"role": "system" | "user" | "assistant", "content": string}',
             "max_completion_tokens": "an integer >= 1 (the same as max_tokens)", **COMMON},
}


class ApiError(Exception):
    """An HTTP error answer: ``status``, ``message``, the ``param`` (field) it is about, the
    OpenAI error ``kind`` and extra response headers (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request. ``prompt``: text or token ids (completions); ``messages``: the chat
    turns (chat). ``max_tokens`` None: the server's default, clipped to the context."""

    kind: Kind
    model: str | None
    prompt: str | tuple[int, ...] | None
    messages: tuple[tuple[str, str], ...] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool

    @property
    def prompt_field(self) -> str:
        """The field that holds the input: what a context-window error names."""
        return "prompt" if self.kind == "completion" else "messages"


def _bad(field: str, got: object) -> ApiError:
    shown = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
    return ApiError(400, f"'{field}' must be {_spec(field)}, got {shown}", field)


def _spec(field: str) -> str:
    for table in FIELDS.values():
        if field in table:
            return table[field]
    return "valid"


def _jsonable(x: object) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def _int(body: dict, field: str, low: int | None = None) -> int | None:
    x = body.get(field)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or (low is not None and x < low):
        raise _bad(field, x)
    return x


def _number(body: dict, field: str, default: float, ok) -> float:
    x = body.get(field)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not ok(x):
        raise _bad(field, x)
    return float(x)


def parse_request(raw: bytes, kind: Kind) -> CompletionRequest:
    """The checked request of a raw JSON body (see the module docstring)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    known = FIELDS[kind]
    for field in body:
        if field not in known:
            raise ApiError(400, f"unknown field '{field}'; this endpoint takes {', '.join(sorted(known))}", field)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", model)
    if "user" in body and not isinstance(body["user"], str):
        raise _bad("user", body["user"])
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(400, f"'n' must be 1: this server returns one completion per request, got "
                            f"{json.dumps(n)[:40] if _jsonable(n) else n!r}; send n separate requests", "n")
    max_tokens = _int(body, "max_tokens", 1)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        other = _int(body, "max_completion_tokens", 1)
        if max_tokens is not None and other != max_tokens:
            raise ApiError(400, "'max_tokens' and 'max_completion_tokens' disagree; send one of them",
                           "max_completion_tokens")
        max_tokens = other
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise _bad("stream_options", options)
        if not stream:
            raise ApiError(400, "'stream_options' is only for stream: true", "stream_options")
        include_usage = options.get("include_usage", False)
    prompt = messages = None
    if kind == "completion":
        prompt = _prompt(body)
    else:
        messages = _messages(body)
    return CompletionRequest(
        kind=kind, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lambda t: 0 <= t <= 2),   # OpenAI's default
        top_p=_number(body, "top_p", 1.0, lambda p: 0 < p <= 1),
        top_k=_int(body, "top_k", 0) or 0,
        min_p=_number(body, "min_p", 0.0, lambda p: 0 <= p <= 1),
        seed=_int(body, "seed"),
        stop=_stop(body), stream=stream, include_usage=include_usage,
    )


def _prompt(body: dict) -> str | tuple[int, ...]:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required: a string or a list of token ids", "prompt")
    p = body["prompt"]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return tuple(p)
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str) and p[0]:
        return p[0]                              # the openai client's one-prompt batch
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise ApiError(400, f"'prompt' holds {len(p)} prompts; this server takes one prompt per request", "prompt")
    raise _bad("prompt", p)


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
    if "messages" not in body:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content}", "messages")
    ms = body["messages"]
    if not isinstance(ms, list) or not ms:
        raise _bad("messages", ms)
    out = []
    for i, m in enumerate(ms):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object {{role, content}}, got {json.dumps(m)[:60]}", where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"unknown field '{where}.{sorted(extra)[0]}'; a message takes role, content, name",
                           f"{where}.{sorted(extra)[0]}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                           f"{where}.role")
        if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]: text parts only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(400, f"'{where}.content' parts must be text parts {{type: text, text}}",
                               f"{where}.content")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'{where}.content' must be a string, got {json.dumps(content)[:40]}",
                           f"{where}.content")
        out.append((role, content))
    return tuple(out)


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or len(s) > MAX_STOP or not all(isinstance(x, str) and x for x in s):
        raise _bad("stop", body["stop"])
    return tuple(s)
