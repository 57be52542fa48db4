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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from client import Prompt
from contract.errors import STOPPING, UNAVAILABLE
from openai_frontend.answer import Deadline, Generations, answer
from openai_frontend.api_errors import RETRY_AFTER_SECONDS, APIError, ClientGone
from openai_frontend.messages import NAMES as MESSAGES_NAMES, CountTokensRequest, MessageReply, MessagesRequest, answer_message
from openai_frontend.replies import ChatReply, CompletionReply
from openai_frontend.responses import ResponseReply, ResponsesRequest, Store, answer_response, conversation
from openai_frontend.schemas import (
    PASSED, ChatCompletionRequest, CompletionRequest, FieldError, GenerationFields, Model, ModelList, Strict,
    UnsupportedField, most_specific, without_unsupported,
)
from openai_frontend.shutdown import Drain
from openai_frontend.tokens import DetokenizeRequest, DetokenizeResponse, TokenizeResponse, tokenize_schema
from openai_frontend.pipeline import PipelineClient, PipelineError, launcher_state

log = logging.getLogger("openai_frontend")
Body = TypeVar("Body", bound=Strict)
# The pipeline names the field at fault first in its messages; these are the names clients sent.
SAMPLING_NAMES = {f.name: f.name for f in PASSED} | {"stop": "stop"}
TOKEN_ROUTES = ("/tokenize", "/detokenize")  # vLLM's paths, without /v1; keys and drains guard them as /v1's
MESSAGES_ROUTES = "/v1/messages"  # Anthropic's Messages API: its errors in Anthropic's shape
NOT_READY = f"{UNAVAILABLE}Triton is not ready (starting, or restarting after a failure); retry"


def _anthropic(path: str) -> bool:
    return path == MESSAGES_ROUTES or path.startswith(MESSAGES_ROUTES + "/")


@dataclass(frozen=True)
class Settings:
    triton_url: str = "127.0.0.1:8001"
    model_name: str = "ensemble"
    request_timeout: float = 600.0  # seconds from arrival to the last byte
    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    triton_pid: int | None = None  # the tritonserver whose stubs to watch; None: any on this host
    launcher_state: str | None = None  # make serve's launcher's state file: the tritonserver now, and restarts
    drain_timeout: float = 30.0  # seconds a stop lets requests in flight finish (openai_frontend/shutdown.py)
    max_model_len: int | None = None  # the model's context, for /tokenize (openai_frontend/tokens.py)
    responses_store_size: int = 1000  # stored responses kept at most (openai_frontend/responses.py)
    responses_store_seconds: float = 3600.0  # and for how long
    max_body_bytes: int = 1 << 20  # a request body past this is refused unread (413)
    body_timeout: float = 30.0  # seconds for a request body to arrive whole (408 past it)


class RestartsCollector(Collector):
    """``launcher_restarts_total``: the processes ``make serve``'s launcher started again (launcher/supervisor.py)."""

    def __init__(self, state: str) -> None:
        self.state = state

    def collect(self):
        family = CounterMetricFamily("launcher_restarts", "Processes the launcher started again after they "
                                     "ended unexpectedly", labels=["process"])
        for process, count in launcher_state(self.state).get("restarts", {}).items():
            family.add_metric([process], count)
        yield family


class Metrics:
    """The front end's own Prometheus metrics, served on its ``/metrics``."""

    def __init__(self, launcher_state: str | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if launcher_state:
            r.register(RestartsCollector(launcher_state))
        self.requests = Counter("openai_requests_total", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("openai_request_duration_seconds", "From arrival to the last byte", ["route"],
                                 buckets=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300], registry=r)
        self.ttft = Histogram("openai_time_to_first_token_seconds", "From arrival to the first generated text",
                              ["route"], buckets=[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60], registry=r)
        self.prompt_tokens = Counter("openai_prompt_tokens_total", "Prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("openai_completion_tokens_total", "Tokens generated for answered requests", registry=r)
        self.in_flight = Gauge("openai_requests_in_flight", "Requests being answered", registry=r)
        self.stalled = Counter("openai_stalled_connections_total", "Connections reset after their client read nothing "
                               "for OPENAI_STALL_TIMEOUT seconds (openai_frontend/connections.py)", registry=r)


def _pipeline_prompts(body: GenerationFields, base: dict, n: int) -> list[Prompt]:
    """n generations of one prompt, seeded ``seed``, ``seed+1``, ... when a seed is given."""
    common = {**body.passed(), "temperature": 1.0 if body.temperature is None else body.temperature,  # OpenAI's default
              "max_tokens": body.budget, "stop": body.stops(), **base}
    return [Prompt(**common | {"seed": None if body.seed is None else body.seed + i}) for i in range(n)]


class Gate:
    """API keys on /v1, refusals while the server drains or Triton is not ready, then metrics for every
    answer: status, and latency to the last byte (streams included), labelled by route template, not raw path."""

    def __init__(self, app, settings: Settings, metrics: Metrics, drain: Drain, readiness: "Readiness") -> None:
        self.app, self.settings, self.metrics, self.drain, self.readiness = app, settings, metrics, drain, readiness

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def recording_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        keys, api = self.settings.api_keys, scope["path"].startswith("/v1") or scope["path"] in TOKEN_ROUTES
        anthropic = _anthropic(scope["path"])
        if api and keys and not _authorized(Request(scope), keys):
            error = APIError(401, "missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
                             code="invalid_api_key")
            await error.response(anthropic)(scope, receive, recording_send)
        elif self.drain.started and scope["method"] == "POST" and api:
            await APIError(503, STOPPING, code="unavailable").response(anthropic)(scope, receive, recording_send)
        elif api and not self.readiness.ready:
            await APIError(503, NOT_READY, code="unavailable").response(anthropic)(scope, receive, recording_send)
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


class Readiness:
    """Whether Triton answers ready, through the channel requests take, looked at every ``WATCH_SECONDS``
    (and by ``/health``): until it does, and again while it does not (a restart), every API route answers
    503 with ``Retry-After``, so a 200 from ``/v1/models`` means a chat request would be served.
    ``on_ready`` is called the first time, so the front end says it answers no later than ``/health``
    first says 200."""

    WATCH_SECONDS = 0.5

    def __init__(self, triton: PipelineClient, on_ready: Callable[[], None]) -> None:
        self.triton, self.on_ready, self.said, self.ready = triton, on_ready, False, False

    async def check(self) -> bool:
        ready = self.ready = await self.triton.ready()
        if ready and not self.said:
            self.said = True
            self.on_ready()
        return ready

    async def watch(self) -> None:
        while True:
            was, said = self.ready, self.said
            if await self.check() != was and said:
                log.warning("Triton is %s", "ready again" if self.ready else "not ready: API routes answer 503 until it is")
            await asyncio.sleep(self.WATCH_SECONDS)


def create_app(settings: Settings, on_ready: Callable[[], None] = lambda: None) -> FastAPI:
    """The app; ``on_ready`` is called once, when Triton first answers ready."""
    triton = PipelineClient(settings.triton_url, settings.triton_pid, settings.launcher_state)
    metrics, drain = Metrics(settings.launcher_state), Drain(settings.drain_timeout)
    readiness = Readiness(triton, on_ready)

    async def lifespan(app: FastAPI):
        await triton.start()
        watching = asyncio.create_task(readiness.watch())
        yield
        watching.cancel()
        await triton.close()

    app = FastAPI(title="triton-chat OpenAI-compatible API", lifespan=lifespan)
    app.state.drain, app.state.metrics = drain, metrics
    app.add_middleware(Gate, settings=settings, metrics=metrics, drain=drain, readiness=readiness)
    _answer_errors(app)
    _serve_status(app, settings, readiness, metrics, drain)
    _serve_generations(app, settings, triton, metrics, drain)
    _serve_tokens(app, settings, triton)
    _serve_messages(app, settings, triton, metrics, drain)
    _serve_responses(app, settings, triton, metrics, drain)
    return app


def _answer_errors(app: FastAPI) -> None:
    """Every failure in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response(_anthropic(request.url.path))

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        """A bug of ours still answers in OpenAI's shape (and is logged with its traceback)."""
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}: {error}", code="internal").response(
            _anthropic(request.url.path))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, error: ClientGone) -> Response:
        """One line, not a traceback: a client that leaves is not a failure of ours."""
        log.info("%s: the client went away before its answer; its generations are cancelled", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(404)
    async def not_found(request: Request, error: Exception) -> JSONResponse:
        return APIError(404, f"no route {request.method} {request.url.path}").response(_anthropic(request.url.path))

    @app.exception_handler(405)
    async def not_allowed(request: Request, error: Exception) -> JSONResponse:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}").response(
            _anthropic(request.url.path))


def _serve_status(app: FastAPI, settings: Settings, readiness: Readiness, metrics: Metrics, drain: Drain) -> None:
    """Health, metrics and the model list."""
    started = int(time.time())

    def model_card() -> Model:
        return Model(id=settings.model_name, created=started)

    @app.get("/health")
    async def health() -> Response:
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        if drain.started:
            return JSONResponse({"status": "draining"}, status_code=503, headers=retry)
        ready = await readiness.check()
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503,
                            headers={} if ready else retry)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        _check_model(model, settings)
        return model_card().model_dump()


def _serve_generations(app: FastAPI, settings: Settings, triton: PipelineClient, metrics: Metrics, drain: Drain) -> None:
    """The two generation routes: each request's fields as pipeline prompts, then ``answer``."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        deadline = Deadline(request, settings.request_timeout)
        body = await _parse(request, ChatCompletionRequest, settings)
        base = {"messages": body.conversation(), "logprobs": body.logprobs or None, "top_logprobs": body.top_logprobs,
                "structured_outputs": body.structured(), **body.tool_fields()}
        names = {**SAMPLING_NAMES, "text_input": "messages", "prompt": "messages", "messages": "messages",
                 "max_tokens": body.budget_name, "logprobs": "logprobs", "top_logprobs": "top_logprobs",
                 "structured_outputs": body.structured_name, "tools": "tools", "tool_choice": "tool_choice"}
        generations = Generations(triton, [_pipeline_prompts(body, base, body.n)], request, deadline, drain, names)
        return await answer(generations, ChatReply(body, settings.model_name), metrics, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        deadline = Deadline(request, settings.request_timeout)
        body = await _parse(request, CompletionRequest, settings)
        base = {"apply_chat_template": False, "logprobs": True if body.logprobs is not None else None,
                "top_logprobs": body.logprobs, "prompt_logprobs": body.logprobs if body.echo else None}
        groups = [_pipeline_prompts(body, {**base, "text_input": text}, body.n) for text in body.prompts()]
        names = {**SAMPLING_NAMES, "text_input": "prompt", "prompt": "prompt", "max_tokens": "max_tokens",
                 "logprobs": "logprobs", "top_logprobs": "logprobs"}
        generations = Generations(triton, groups, request, deadline, drain, names)
        return await answer(generations, CompletionReply(body, settings.model_name), metrics, "/v1/completions")


def _serve_tokens(app: FastAPI, settings: Settings, triton: PipelineClient) -> None:
    """``/tokenize`` and ``/detokenize``: the pipeline's own preprocess and postprocess (openai_frontend/tokens.py)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _parse(request, tokenize_schema, settings)
        names = {"text_input": "prompt", "messages": "messages", "tools": "tools", "chat_template_kwargs": "chat_template_kwargs"}
        try:
            ids = await triton.tokenize(body.prompt_of())
        except PipelineError as e:
            raise APIError.of(e, names) from None
        return TokenizeResponse(count=len(ids), max_model_len=settings.max_model_len, tokens=ids).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _parse(request, DetokenizeRequest, settings)
        try:
            text = await triton.detokenize(body.tokens) if body.tokens else ""
        except PipelineError as e:
            raise APIError.of(e, {"output_ids": "tokens"}) from None
        return DetokenizeResponse(prompt=text).model_dump()


def _serve_responses(app: FastAPI, settings: Settings, triton: PipelineClient, metrics: Metrics, drain: Drain) -> None:
    """OpenAI's Responses API over the same pipeline, with its bounded store (openai_frontend/responses.py)."""
    store = Store(settings.responses_store_size, settings.responses_store_seconds)
    names = {**SAMPLING_NAMES, "messages": "input", "text_input": "input", "prompt": "input", "max_tokens": "max_output_tokens",
             "structured_outputs": "text.format", "tools": "tools", "tool_choice": "tool_choice"}

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        deadline = Deadline(request, settings.request_timeout)
        body = await _parse(request, ResponsesRequest, settings, openai=False)
        earlier = store.get(body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
        history = earlier + conversation(body.items())
        turns = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
        prompt = Prompt(messages=turns, max_tokens=body.max_output_tokens, top_p=body.top_p, seed=body.seed,
                        temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
                        structured_outputs=body.structured(), **body.tool_fields())
        generations = Generations(triton, [[prompt]], request, deadline, drain, names)
        return await answer_response(generations, ResponseReply(body, settings.model_name), store, history, metrics,
                                     "/v1/responses")

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return store.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _serve_messages(app: FastAPI, settings: Settings, triton: PipelineClient, metrics: Metrics, drain: Drain) -> None:
    """Anthropic's Messages API over the same pipeline (openai_frontend/messages.py)."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        deadline = Deadline(request, settings.request_timeout)
        body = await _parse(request, MessagesRequest, settings, openai=False)
        generations = Generations(triton, [[body.prompt()]], request, deadline, drain, MESSAGES_NAMES)
        return await answer_message(generations, MessageReply(body, settings.model_name), metrics, "/v1/messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await _parse(request, CountTokensRequest, settings, openai=False)
        try:
            ids = await triton.tokenize(body.prompt())
        except PipelineError as e:
            raise APIError.of(e, MESSAGES_NAMES) from None
        return {"input_tokens": len(ids)}


def _authorized(request: Request, keys: frozenset[str]) -> bool:
    """``Authorization: Bearer <key>`` (OpenAI's) or ``x-api-key: <key>`` (Anthropic's)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    return bool(token) and any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


def _check_model(model: str, settings: Settings) -> None:
    if model != settings.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {settings.model_name!r} (GET /v1/models)",
                       "model", "model_not_found")

async def _body(request: Request, limit: int, seconds: float) -> bytes:
    """The request body, refused with a 413 before it is read past ``limit`` bytes: at once from its
    Content-Length, or as a chunked one passes the limit. A body the pipeline would refuse anyway must not
    be held whole first (a hundred 70 MB bodies at once held 7 GB). One that has not arrived whole within
    ``seconds`` gets a 408: a client sending a byte a second holds a connection, not the server."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; the limit is {limit} bytes (OPENAI_MAX_BODY_BYTES)")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body passed the limit of {limit} bytes (OPENAI_MAX_BODY_BYTES)")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {seconds:g} s (OPENAI_BODY_TIMEOUT); "
                            f"{size} bytes came") from None
    return b"".join(chunks)


async def _parse(request: Request, schema: type[Body] | Callable[[dict], type[Body]], settings: Settings,
                 openai: bool = True) -> Body:
    """The body as ``schema`` (or the schema ``schema`` picks for the body), or a 400 that names the field.
    ``openai``: OpenAI's fields this server does not do are refused by name, their off values dropped."""
    raw = await _body(request, settings.max_body_bytes, settings.body_timeout)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # Python's parser gives up on thousands of nested brackets
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if not isinstance(schema, type):
        schema = schema(data)
    try:
        body = schema.model_validate(without_unsupported(data) if openai else data)
        body.check()
    except FieldError as e:
        raise APIError(400, str(e), e.field, "unsupported_field" if isinstance(e, UnsupportedField) else None) from None
    except ValidationError as e:
        param, message = most_specific(e)
        raise APIError(400, f"{param + ': ' if param else ''}{message}", param) from None
    if body.model is not None:  # optional on /tokenize and /detokenize, as vLLM's
        _check_model(body.model, settings)
    return body
