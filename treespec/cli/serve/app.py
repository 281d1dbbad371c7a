"""The HTTP front door: an OpenAI-compatible Starlette app over one engine loop.

    POST /v1/completions        text or token ids in, text out (stream: server-sent events)
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models, /health, /metrics (Prometheus text)

A handler checks the body (``protocol.parse_request``: 400 naming the field), encodes the
prompt, checks it fits the context (400 with the numbers), and submits a ``Job`` to the engine
(429 with Retry-After past the queue bound; 503 while draining). The engine hands token ids back
through the event loop; the text streamed is what ``IncrementalText`` releases (as ``treespec
generate`` prints it), held back by ``TextStream`` so that nothing at or past a stop string is
ever sent. A client that disconnects cancels its request at the next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from treespec.cli.serve.engine import Done, Draining, Engine, Error, Job, QueueFull, Tokens
from treespec.cli.serve.metrics import Metrics
from treespec.cli.serve.protocol import ApiError, CompletionRequest, Kind, parse_request
from treespec.core.sampling import SamplingConfig
from treespec.runtime.generator import encode_prompt
from treespec.runtime.server import SpeculativeServer
from treespec.runtime.streaming import IncrementalText

DISCONNECT_POLL_S = 0.25   # a non-streamed request checks this often whether its client left


class TextStream:
    """Token ids in, text out: ``IncrementalText``'s complete characters, minus the stop
    strings. The last (longest stop - 1) characters are held back until more text shows they
    do not start a stop string; at the first stop string the text ends before it."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.text = IncrementalText(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, ids) -> str:
        self.pending += self.text.push(ids)
        return self._release(final=False)

    def flush(self) -> str:
        self.pending += self.text.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        cut = len(self.pending) if final else len(self.pending) - self.hold
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out


class Front:
    """What the handlers share: the server, its engine and metrics, and the limits."""

    def __init__(self, server: SpeculativeServer, model_id: str, max_queue: int, max_batch: int,
                 default_max_tokens: int, drain_timeout: float):
        if server.target.tokenizer is None:
            raise ValueError("the HTTP server needs a target with a tokenizer (text in, text out)")
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be an int >= 1, got {default_max_tokens!r}")
        self.server, self.model_id = server, model_id
        self.tokenizer = server.target.tokenizer
        self.metrics = Metrics()
        self.engine = Engine(server, max_queue=max_queue, max_batch=max_batch, observer=self.metrics)
        self.metrics.attach(self.engine)
        self.default_max_tokens, self.drain_timeout = default_max_tokens, drain_timeout
        self.created = int(time.time())

    def encode(self, req: CompletionRequest):
        """LongTensor[P] of the request's prompt (a 400 naming the field when it cannot be)."""
        try:
            if req.kind == "completion":
                prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
                return encode_prompt(self.server.target, prompt, chat=False)
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this model has no chat template; send the text to /v1/completions")
            messages = [{"role": r, "content": c} for r, c in req.messages]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return encode_prompt(self.server.target, list(ids), chat=False)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"'{req.prompt_field}': {e}", req.prompt_field) from None

    def max_new_tokens(self, req: CompletionRequest, prompt_tokens: int) -> int:
        """The request's limit: max_tokens, or the server's default clipped to the context; a
        400 with the numbers when it cannot fit."""
        limit, budget, why = self.server.room()
        room = limit - prompt_tokens - budget
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens; with the tree budget of {budget} it leaves "
                                f"no room in the context window of {limit} tokens ({why}); shorten it",
                           req.prompt_field)
        if req.max_tokens is None:
            return min(self.default_max_tokens, room)
        if req.max_tokens > room:
            raise ApiError(400, f"'max_tokens' is {req.max_tokens}, but the prompt's {prompt_tokens} tokens + "
                                f"{req.max_tokens} + the tree budget of {budget} = "
                                f"{prompt_tokens + req.max_tokens + budget} exceed the context window of {limit} "
                                f"tokens ({why}); use max_tokens <= {room}", "max_tokens")
        return req.max_tokens


# ---------------------------------------------------------------------- responses
def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(text: TextStream, done: Done) -> str:
    return "stop" if text.stopped or done.reason == "eos" else "length"


def _body(front: Front, req: CompletionRequest, rid: str, text: str, reason: str | None, chunk: bool) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    elif chunk:
        choice = {"index": 0, "delta": {"content": text} if text or reason is None else {}, "logprobs": None,
                  "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        kind = "chat.completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": front.model_id, "choices": [choice]}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ---------------------------------------------------------------------- handlers
async def completions(request: Request) -> Response:
    return await _complete(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _complete(request, "chat")


async def _complete(request: Request, kind: Kind) -> Response:
    front: Front = request.app.state.front
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    try:
        req = parse_request(await request.body(), kind)
        if req.model is not None and req.model != front.model_id:
            raise ApiError(404, f"'model' {req.model!r} is not served here; this server serves {front.model_id!r} "
                                f"(GET /v1/models)", "model", "model_not_found")
        ids = front.encode(req)
        max_new = front.max_new_tokens(req, ids.numel())
        try:
            sampling = SamplingConfig(req.temperature, req.top_k, req.top_p, req.min_p)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"the sampling settings are invalid: {e}", "temperature") from None
        job = Job(ids, sampling, max_new, req.seed, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            front.engine.submit(job)
        except QueueFull as e:
            front.metrics.requests.labels("rejected_queue_full").inc()
            raise ApiError(429, f"{e}", None, "rate_limit_error", {"Retry-After": str(e.retry_after)}) from None
        except Draining:
            front.metrics.requests.labels("draining").inc()
            raise ApiError(503, "the server is shutting down and takes no new requests", None,
                           "service_unavailable", {"Retry-After": "5"}) from None
    except ApiError as e:
        if e.status in (400, 404):
            front.metrics.requests.labels("bad_request").inc()
        return _error(e)
    front.metrics.prompt_tokens.inc(ids.numel())
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)
    if req.stream:
        return StreamingResponse(_stream(front, req, job, events, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(request, front, req, job, events, rid)


async def _whole(request: Request, front: Front, req: CompletionRequest, job: Job, events: asyncio.Queue,
                 rid: str) -> Response:
    text, parts = TextStream(front.tokenizer, req.stop), []
    finished = False
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)     # nobody reads it; the finally cancels
                continue
            if isinstance(ev, Tokens):
                parts.append(text.push(ev.ids))
                if text.stopped:
                    front.engine.cancel(job)
            elif isinstance(ev, Done):
                finished = True
                parts.append(text.flush())
                body = _body(front, req, rid, "".join(parts), _finish_reason(text, ev), chunk=False)
                body["usage"] = _usage(job.ids.numel(), len(ev.tokens))
                return JSONResponse(body)
            else:
                finished = True
                return _error(ApiError(500, ev.message, None, "server_error"))
    except Exception as e:                               # noqa: BLE001 - this request's own failure
        front.engine.cancel(job)
        finished = True
        return _error(ApiError(500, f"the request failed: {type(e).__name__}: {e}", None, "server_error"))
    finally:
        if not finished:
            front.engine.cancel(job)


async def _stream(front: Front, req: CompletionRequest, job: Job, events: asyncio.Queue, rid: str):
    text = TextStream(front.tokenizer, req.stop)
    finished = False
    try:
        if req.kind == "chat":
            first = _body(front, req, rid, "", None, chunk=True)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        while True:
            ev = await events.get()
            if isinstance(ev, Tokens):
                piece = text.push(ev.ids)
                if text.stopped:
                    front.engine.cancel(job)
                if piece:
                    yield _sse(_body(front, req, rid, piece, None, chunk=True))
            elif isinstance(ev, Done):
                finished = True
                piece = text.flush()
                if piece:
                    yield _sse(_body(front, req, rid, piece, None, chunk=True))
                last = _body(front, req, rid, "", _finish_reason(text, ev), chunk=True)
                usage = _usage(job.ids.numel(), len(ev.tokens))
                last["usage"] = usage
                yield _sse(last)
                if req.include_usage:
                    tail = _body(front, req, rid, "", None, chunk=True)
                    tail["choices"], tail["usage"] = [], usage
                    yield _sse(tail)
                yield _sse("[DONE]")
                return
            else:
                finished = True
                yield _sse(ApiError(500, ev.message, None, "server_error").body())
                yield _sse("[DONE]")
                return
    except Exception as e:                               # noqa: BLE001 - this request's own failure
        front.engine.cancel(job)
        finished = True
        yield _sse(ApiError(500, f"the request failed: {type(e).__name__}: {e}", None, "server_error").body())
        yield _sse("[DONE]")
    finally:
        if not finished:                                 # the client left (the task was cancelled)
            front.engine.cancel(job)


async def models(request: Request) -> Response:
    front: Front = request.app.state.front
    return JSONResponse({"object": "list", "data": [{"id": front.model_id, "object": "model",
                                                     "created": front.created, "owned_by": "treespec"}]})


async def health(request: Request) -> Response:
    front: Front = request.app.state.front
    if front.engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok", "live": front.engine.live, "queued": front.engine.queue_depth})


async def metrics(request: Request) -> Response:
    return Response(request.app.state.front.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def make_app(server: SpeculativeServer, model_id: str, max_queue: int = 64, max_batch: int = 8,
             default_max_tokens: int = 256, drain_timeout: float = 30.0) -> Starlette:
    """The ASGI app over ``server`` (see the module docstring). Its lifespan starts the engine
    loop and, at shutdown, drains it: live requests get up to ``drain_timeout`` s to finish."""
    front = Front(server, model_id, max_queue, max_batch, default_max_tokens, drain_timeout)

    @asynccontextmanager
    async def lifespan(app):
        front.engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, front.engine.drain, front.drain_timeout)

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.front = front
    return app
