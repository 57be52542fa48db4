"""The OpenAI-compatible HTTP API: FastAPI routes over ``Triton.generate``.

This process never tokenizes: chat messages go to the ensemble's ``messages`` input and raw prompts to
``text_input`` with the chat template off, so preprocess (and a tokenizer swapped into it) decides the
tokens for OpenAI clients exactly as for every other client.

A request is answered the OpenAI way whatever happens: a body that is not JSON, a wrong type or an
unsupported field is a 400 naming the field; the pipeline's own refusals keep their messages; overload and
a dead stub are 503 with ``Retry-After``; a request past its deadline is 504. Streaming errors that come
after the first byte arrive as an ``error`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from client import Chunk, Prompt
from contract.errors import STOPPING, UNAVAILABLE
from openai_frontend.schemas import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatDelta,
    ChatLogprobs, ChatMessage, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Error,
    ErrorResponse, FieldError, GenerationFields, Model, ModelList, UnsupportedField, Usage, without_unsupported,
)
from openai_frontend.shutdown import Drain
from openai_frontend.triton import PipelineError, Triton

TIMEOUT_HEADER = "X-Request-Timeout"  # seconds; shortens (never lengthens) the server's deadline
RETRY_AFTER_SECONDS = 1
log = logging.getLogger("openai_frontend")
STATUS = {"invalid": 400, "overloaded": 503, "unavailable": 503, "internal": 500, "cancelled": 499, "timeout": 504}
# OpenAI's: every client mistake is an invalid_request_error (the code says which), a failure of ours a
# server_error; overload and a deadline keep names of their own, as vLLM's do.
ERROR_TYPES = {503: "service_unavailable", 504: "timeout"}
# The pipeline names the field at fault first in its messages; these are the names clients sent.
SAMPLING_NAMES = {n: n for n in ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "seed", "stop", "ignore_eos")}


@dataclass(frozen=True)
class Settings:
    triton_url: str = "127.0.0.1:8001"
    model_name: str = "ensemble"
    request_timeout: float = 600.0  # seconds from arrival to the last byte
    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    triton_pid: int | None = None  # the tritonserver whose stubs to watch; None: any on this host
    drain_timeout: float = 30.0  # seconds a stop lets requests in flight finish (openai_frontend/shutdown.py)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def of(cls, error: PipelineError, names: dict[str, str]) -> "APIError":
        """The pipeline's error in the client's words: the field it names first (an input tensor, such as
        ``text_input``) becomes the one the client sent (``prompt``), and ``param``."""
        message, param = str(error), None
        field = re.match(r"[a-z_]+", message) if error.kind == "invalid" else None
        if field and field.group() in names:
            param = names[field.group()]
            message = param + message[field.end():]
        return cls(STATUS[error.kind], message, param, code=None if error.kind == "invalid" else error.kind)

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=Error(message=str(self), type=kind, param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 503 else {}
        return JSONResponse(self.body(), status_code=self.status, headers=retry)


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


class Metrics:
    """The front end's own Prometheus metrics, served on its ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("openai_requests_total", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("openai_request_duration_seconds", "From arrival to the last byte", ["route"],
                                 buckets=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300], registry=r)
        self.ttft = Histogram("openai_time_to_first_token_seconds", "From arrival to the first generated text",
                              ["route"], buckets=[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60], registry=r)
        self.prompt_tokens = Counter("openai_prompt_tokens_total", "Prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("openai_completion_tokens_total", "Tokens generated for answered requests", registry=r)
        self.in_flight = Gauge("openai_requests_in_flight", "Requests being answered", registry=r)


class Deadline:
    def __init__(self, request: Request, settings: Settings) -> None:
        seconds = settings.request_timeout
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                asked = float("nan")
            if not 0 < asked < float("inf"):
                raise APIError(400, f"header {TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}",
                               TIMEOUT_HEADER)
            seconds = min(seconds, asked)
        self.seconds = seconds
        self.at = asyncio.get_running_loop().time() + seconds

    def error(self) -> APIError:
        return APIError(504, f"the request did not finish within its deadline of {self.seconds:g} s", code="timeout")


def _pipeline_prompts(body: GenerationFields, base: dict, n: int) -> list[Prompt]:
    """n generations of one prompt, seeded ``seed``, ``seed+1``, ... when a seed is given."""
    common = dict(
        max_tokens=body.budget, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p, top_k=body.top_k, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        stop=body.stops(), ignore_eos=body.ignore_eos, **base,
    )
    return [Prompt(**common, seed=None if body.seed is None else body.seed + i) for i in range(n)]


class Reply:
    """One API's way to present generations: the chat or the legacy completions shape."""

    def __init__(self, body: GenerationFields, model: str) -> None:
        self.body, self.model = body, model
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    prefix = ""

    def chunk(self, index: int, piece: Chunk, first: bool) -> dict: ...

    def whole(self, choices: list[tuple[str, str, list[dict] | None]], usage: Usage) -> dict: ...

    def usage_chunk(self, usage: Usage) -> dict: ...


class ChatReply(Reply):
    prefix = "chatcmpl"

    def _logprobs(self, items: list[dict] | None) -> ChatLogprobs | None:
        return ChatLogprobs(content=items or []) if self.body.logprobs else None

    def chunk(self, index: int, piece: Chunk, first: bool) -> dict:
        delta = ChatDelta(role="assistant" if first else None, content=piece.text_output)
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(piece.token_logprobs),
                                 finish_reason=piece.finish_reason or None)
        data = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump(
            exclude=None if self.body.include_usage else {"usage"})
        data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # OpenAI leaves out what a delta lacks
        return data

    def whole(self, choices, usage):
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            ChatChoice(index=i, message=ChatMessage(content=text), logprobs=self._logprobs(items), finish_reason=reason)
            for i, (text, reason, items) in enumerate(choices)
        ]).model_dump()

    def usage_chunk(self, usage):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage).model_dump()


class CompletionReply(Reply):
    prefix = "cmpl"

    def __init__(self, body: CompletionRequest, model: str) -> None:
        super().__init__(body, model)
        self.offsets: dict[int, int] = {}  # characters of each choice's text so far, for text_offset

    def _logprobs(self, index: int, items: list[dict] | None) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        items, offsets = items or [], []
        for item in items:
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(item["token"])
        return CompletionLogprobs(
            tokens=[i["token"] for i in items], token_logprobs=[i["logprob"] for i in items],
            top_logprobs=[None if i["logprob"] is None else {t["token"]: t["logprob"] for t in i["top_logprobs"]}
                          for i in items], text_offset=offsets,
        )

    def _echo(self, index: int) -> str:
        """With ``echo``, the prompt choice ``index`` continues, before its first text."""
        return self.body.prompts()[index // self.body.n] if self.body.echo else ""

    def chunk(self, index, piece, first):
        text = (self._echo(index) if first else "") + piece.text_output
        items = (piece.prompt_token_logprobs or []) + piece.token_logprobs if piece.prompt_token_logprobs else piece.token_logprobs
        choice = CompletionChoice(index=index, text=text, logprobs=self._logprobs(index, items),
                                  finish_reason=piece.finish_reason or None)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump(
            exclude=None if self.body.include_usage else {"usage"})

    def whole(self, choices, usage):
        return Completion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            CompletionChoice(index=i, text=self._echo(i) + text, logprobs=self._logprobs(i, items), finish_reason=reason)
            for i, (text, reason, items) in enumerate(choices)
        ]).model_dump()

    def usage_chunk(self, usage):
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage).model_dump()


class Gate:
    """API keys on /v1, refusals while the server drains, then metrics for every answer: status, and
    latency to the last byte (streams included), labelled by route template, not raw path."""

    def __init__(self, app, settings: Settings, metrics: Metrics, drain: Drain) -> None:
        self.app, self.settings, self.metrics, self.drain = app, settings, metrics, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def recording_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        keys = self.settings.api_keys
        if scope["path"].startswith("/v1") and keys and not _authorized(Request(scope), keys):
            error = APIError(401, "missing or invalid API key: send Authorization: Bearer <key>", code="invalid_api_key")
            await error.response()(scope, receive, recording_send)
        elif self.drain.started and scope["method"] == "POST" and scope["path"].startswith("/v1"):
            await APIError(503, STOPPING, code="unavailable").response()(scope, receive, recording_send)
        else:
            self.metrics.in_flight.inc()
            self.drain.in_flight += 1
            try:
                await self.app(scope, receive, recording_send)
            finally:
                self.metrics.in_flight.dec()
                self.drain.in_flight -= 1
        route = getattr(scope.get("route"), "path", "other")
        self.metrics.requests.labels(route, str(status[0])).inc()
        self.metrics.latency.labels(route).observe(time.perf_counter() - start)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def create_app(settings: Settings, on_ready: Callable[[], None] = lambda: None) -> FastAPI:
    """The app; ``on_ready`` is called once, when Triton first answers ready (so is ``/health``)."""
    triton = Triton(settings.triton_url, settings.triton_pid)
    metrics = Metrics()
    drain = Drain(settings.drain_timeout)

    announced = []

    def ready_now() -> None:
        """Said once, and before ``/health`` first answers 200."""
        if not announced:
            announced.append(True)
            on_ready()

    async def announce() -> None:
        while not await triton.ready():
            await asyncio.sleep(0.5)
        ready_now()

    async def lifespan(app: FastAPI):
        await triton.start()
        waiting = asyncio.create_task(announce())
        yield
        waiting.cancel()
        await triton.close()

    app = FastAPI(title="triton-chat OpenAI-compatible API", lifespan=lifespan)
    app.state.drain = drain
    app.add_middleware(Gate, settings=settings, metrics=metrics, drain=drain)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        """A bug of ours still answers in OpenAI's shape (and is logged with its traceback)."""
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}: {error}", code="internal").response()

    @app.exception_handler(ClientGone)
    async def gone(request: Request, error: ClientGone) -> Response:
        """One line, not a traceback: a client that leaves is not a failure of ours."""
        log.info("%s: the client went away before its answer; its generations are cancelled", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(404)
    async def not_found(request: Request, error: Exception) -> JSONResponse:
        return APIError(404, f"no route {request.method} {request.url.path}").response()

    @app.exception_handler(405)
    async def not_allowed(request: Request, error: Exception) -> JSONResponse:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}").response()

    @app.get("/health")
    async def health() -> Response:
        if drain.started:
            return JSONResponse({"status": "draining"}, status_code=503)
        ready = await triton.ready()
        if ready:
            ready_now()
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    started = int(time.time())

    def model_card() -> Model:
        return Model(id=settings.model_name, created=started)

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        _check_model(model, settings)
        return model_card().model_dump()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        deadline = Deadline(request, settings)
        body = await _parse(request, ChatCompletionRequest, settings)
        base = {"messages": body.conversation(), "logprobs": body.logprobs or None, "top_logprobs": body.top_logprobs}
        names = {**SAMPLING_NAMES, "text_input": "messages", "prompt": "messages", "messages": "messages",
                 "max_tokens": body.budget_name, "logprobs": "logprobs", "top_logprobs": "top_logprobs"}
        return await _answer(request, ChatReply(body, settings.model_name), [_pipeline_prompts(body, base, body.n)],
                             deadline, "/v1/chat/completions", names)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        deadline = Deadline(request, settings)
        body = await _parse(request, CompletionRequest, settings)
        base = {"apply_chat_template": False, "logprobs": True if body.logprobs is not None else None,
                "top_logprobs": body.logprobs, "prompt_logprobs": body.logprobs if body.echo else None}
        groups = [_pipeline_prompts(body, {**base, "text_input": text}, body.n) for text in body.prompts()]
        names = {**SAMPLING_NAMES, "text_input": "prompt", "prompt": "prompt", "max_tokens": "max_tokens",
                 "logprobs": "logprobs", "top_logprobs": "logprobs"}
        return await _answer(request, CompletionReply(body, settings.model_name), groups, deadline, "/v1/completions",
                             names)

    async def _answer(request: Request, reply: Reply, groups: list[list[Prompt]], deadline: Deadline, route: str,
                      names: dict[str, str]) -> Response:
        """Start every generation (``groups``: the n prompts of each client prompt, choices numbered in
        that order), then answer whole or as a stream."""
        start = time.perf_counter()
        prompts = [p for group in groups for p in group]
        streams = [triton.generate(p) for p in prompts]
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[Chunk]) -> None:
            try:
                async for piece in stream:
                    merged.put_nowait((index, piece))
            except PipelineError as e:
                merged.put_nowait((index, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        watcher = asyncio.create_task(_until_disconnected(request))
        cut = asyncio.create_task(drain.expired.wait())

        async def next_piece() -> tuple[int, Chunk | PipelineError]:
            """The next piece of any generation; raises APIError at the deadline or when a drain runs out,
            and ClientGone when the client went away."""
            getter = asyncio.ensure_future(merged.get())
            try:
                timeout = deadline.at - asyncio.get_running_loop().time()
                done, _ = await asyncio.wait({getter, watcher, cut}, timeout=max(0.0, timeout),
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if getter in done:
                return getter.result()
            if watcher in done:
                raise ClientGone()
            if cut in done:
                raise APIError(503, f"{UNAVAILABLE}the server is stopping and its drain timeout "
                                    f"({drain.seconds:g} s) ended this reply; retry", code="unavailable")
            raise deadline.error()

        async def close() -> None:
            watcher.cancel()
            cut.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()  # cancels the Triton stream, so llm frees the row

        prompt_tokens, completion_tokens = [0] * len(prompts), [0] * len(prompts)
        finished: set[int] = set()

        def take(index: int, piece: Chunk) -> None:
            prompt_tokens[index], completion_tokens[index] = piece.prompt_tokens, piece.completion_tokens
            if piece.finish_reason:
                finished.add(index)

        def so_far() -> Usage:
            n = len(groups[0])  # each client prompt counts once, however many choices it has (as OpenAI counts)
            return Usage.of(sum(prompt_tokens[g * n] for g in range(len(groups))), sum(completion_tokens))

        def total() -> Usage:
            usage = so_far()
            metrics.prompt_tokens.inc(usage.prompt_tokens)
            metrics.completion_tokens.inc(usage.completion_tokens)
            return usage

        async def more() -> list[tuple[int, Chunk]]:
            index, item = await next_piece()
            if isinstance(item, PipelineError):
                raise APIError.of(item, names)
            return [(index, item)]

        # Every generation's first piece before answering: the pipeline's refusals become the status.
        early: list[tuple[int, Chunk]] = []
        try:
            while len({index for index, _ in early}) < len(prompts):
                early += await more()
        except BaseException:
            await close()
            raise
        metrics.ttft.labels(route).observe(time.perf_counter() - start)

        if not reply.body.stream:
            texts, reasons = [""] * len(prompts), [""] * len(prompts)
            logprobs: list[list[dict] | None] = [None] * len(prompts)
            try:
                pending = early
                while True:
                    for index, piece in pending:
                        take(index, piece)
                        texts[index] += piece.text_output
                        reasons[index] = piece.finish_reason
                        if piece.token_logprobs is not None:  # after the prompt's, when echoed (the first piece)
                            logprobs[index] = (logprobs[index] or []) + (piece.prompt_token_logprobs or []) + piece.token_logprobs
                    if len(finished) == len(prompts):
                        break
                    pending = await more()
            finally:
                await close()
            return JSONResponse(reply.whole(list(zip(texts, reasons, logprobs)), total()))

        async def events() -> AsyncIterator[bytes]:
            begun: set[int] = set()
            try:
                pending = early
                while True:
                    for index, piece in pending:
                        take(index, piece)
                        if index not in begun or piece.text_output or piece.finish_reason or piece.token_logprobs:
                            data = reply.chunk(index, piece, index not in begun)
                            if reply.body.continuous_usage:
                                data["usage"] = so_far().model_dump()
                            yield _sse(data)
                        begun.add(index)
                    if len(finished) == len(prompts):
                        break
                    pending = await more()
                usage = total()
                if reply.body.include_usage:
                    yield _sse(reply.usage_chunk(usage))
            except APIError as e:
                yield _sse(e.body())
            except (ClientGone, asyncio.CancelledError) as gone:  # seen by our watcher, or by Starlette's
                log.info("%s: the client went away during a stream; its generations are cancelled", route)
                if isinstance(gone, asyncio.CancelledError):
                    raise
                return
            finally:
                await close()
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _authorized(request: Request, keys: frozenset[str]) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


def _union_member(part: str | int) -> bool:
    """pydantic names the member of a union a location went through (``str``, ``list[ContentPart]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _check_model(model: str, settings: Settings) -> None:
    if model != settings.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {settings.model_name!r} (GET /v1/models)",
                       "model", "model_not_found")


async def _parse(request: Request, schema: type[GenerationFields], settings: Settings) -> GenerationFields:
    """The body as ``schema``, or a 400 that names the field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # Python's parser gives up on thousands of nested brackets
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = schema.model_validate(without_unsupported(data))
        body.check()
    except FieldError as e:
        raise APIError(400, str(e), e.field, "unsupported_field" if isinstance(e, UnsupportedField) else None) from None
    except ValidationError as e:
        # The most specific error (a union reports each member's; on a tie its list form), its location
        # without the member names.
        error = max(e.errors(), key=lambda err: (len(err["loc"]), any("[" in str(p) for p in err["loc"])))
        param = ".".join(str(part) for part in error["loc"] if not _union_member(part)) or None
        raise APIError(400, f"{param + ': ' if param else ''}{error['msg']}", param) from None
    _check_model(body.model, settings)
    return body
