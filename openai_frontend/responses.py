"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``) over the pipeline.

Why: the OpenAI Agents SDK and newer OpenAI clients speak this API first. A request becomes the same
pipeline prompt a chat completion does: ``instructions`` as the system turn, message items as turns,
``function_call`` items as the assistant's tool calls and ``function_call_output`` items as tool turns;
``text.format`` becomes the reply's structured output, and function tools the chat template's tools.
The reply is a response object (a thinking model's ``reasoning`` item with its ``reasoning_text``, a
``message`` item with ``output_text``, then ``function_call`` items), whole or as OpenAI's typed
server-sent events, in OpenAI's order. Reasoning items sent back in ``input`` are dropped, as thinking
templates drop earlier turns' thinking.

Stored responses (``store``, true by default as OpenAI's) are kept in memory, bounded by count and by age
(``RESPONSES_STORE_SIZE``, ``RESPONSES_STORE_SECONDS``): ``previous_response_id`` continues one (its
conversation and output before the new input; its instructions are not carried over, as OpenAI's are
not), ``GET`` returns it and ``DELETE`` forgets it; a missing or expired id is a 404 naming it. What this
server does not do is refused by name: built-in tools (web search, file search, computer use, ...),
image and file inputs, ``background``, reasoning options (effort, summaries), ``include``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, model_validator

from client import Chunk
from contract.tools import ToolCallParser
from openai_frontend.answer import Generations, counted
from openai_frontend.api_errors import APIError, ClientGone
from openai_frontend.schemas import FieldError, Strict, UnsupportedField, Usage, most_specific, text_only

log = logging.getLogger("openai_frontend")


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text's, sent back as it came
    logprobs: list | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: object) -> object:
        return text_only(part)


class MessageItem(Strict):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    type: Literal["message"] | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(Strict):
    """An earlier reply's reasoning, sent back (the Agents SDK does): dropped."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list = []
    content: list | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    parameters: dict | None = None
    description: str | None = None
    strict: bool | None = None  # the arguments always follow the parameters here

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"{data.get('type')!r} is a built-in tool, which this server does not run; send function tools")
        return data

    def pipeline(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        return {"type": "function", "function": function | ({"description": self.description} if self.description else {})}


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # accepted: the prefix cache finds shared prefixes by itself
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    background: bool | None = None
    reasoning: dict | None = None
    include: list | None = None

    def check(self) -> None:
        if self.background:
            raise UnsupportedField("background", "background mode is not supported by this server")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise UnsupportedField("reasoning", "reasoning options (effort, summaries) are not supported by this server: "
                                   "a thinking chat template's thinking comes back whole, as a reasoning item")
        if self.include:
            raise UnsupportedField("include", "no extra output data is served")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if self.format is not None and self.format.type == "json_schema" and self.format.schema_ is None:
            raise FieldError("text.format.schema", "text.format.schema is required with type json_schema")
        self.items()

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text else None

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        """``input`` as items, each checked (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        kinds = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
                 "reasoning": ReasoningItem}
        items = []
        for i, raw in enumerate(self.input):
            kind = raw.get("type", "message") if isinstance(raw, dict) else None
            if kind not in kinds:
                raise UnsupportedField(f"input.{i}.type", f"input items of type {kind!r} are not supported by this server; "
                                       "send message, function_call, function_call_output or reasoning items")
            try:
                items.append(kinds[kind].model_validate(raw))
            except ValidationError as e:
                where, message = most_specific(e, ("input", i))
                raise FieldError(where, f"{where}: {message}") from None
        return items

    def structured(self) -> dict | None:
        if self.format is None or self.format.type == "text":
            return None
        return {"json_object": True} if self.format.type == "json_object" else {"json": self.format.schema_}

    def tool_fields(self) -> dict:
        choice = self.tool_choice.name if isinstance(self.tool_choice, NamedFunction) else self.tool_choice
        return {"tools": [t.pipeline() for t in self.tools] if self.tools else None, "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls}

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def conversation(items: list) -> list[dict]:
    """Items as the pipeline's turns: a function_call joins the assistant turn before it (or makes one)."""
    turns: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            turns.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, ReasoningItem):
            continue
        elif isinstance(item, FunctionCallItem):
            if not turns or turns[-1]["role"] != "assistant":
                turns.append({"role": "assistant", "content": ""})
            turns[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return turns


class Store:
    """Stored responses, by id: at most ``size``, each for ``seconds`` (the oldest go first)."""

    def __init__(self, size: int, seconds: float) -> None:
        self.size, self.seconds = size, seconds
        self._entries: OrderedDict[str, tuple[float, dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, turns: list[dict]) -> None:
        if self.size <= 0:
            return
        self._entries[response["id"]] = (time.monotonic(), response, turns)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, field: str = "response_id") -> tuple[dict, list[dict]]:
        """The response and its conversation (its turns and its output's), or a 404 naming the id."""
        entry = self._entries.get(response_id)
        if entry is None or time.monotonic() - entry[0] > self.seconds:
            self._entries.pop(response_id, None)
            raise APIError(404, f"no stored response {response_id!r}: it was never stored (store: false), was deleted, "
                                f"or expired ({self.seconds:g} s, at most {self.size} kept)", field, "not_found")
        return entry[1], entry[2]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


class ResponseReply:
    """One generation as a response object: its output items, and the events that build them."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.message_id, self.reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        self.parser = ToolCallParser() if body.calls_tools else None
        self.text, self.reasoning, self.finish_reason = "", "", ""

    def read(self, piece: Chunk) -> tuple[str, list[dict]]:
        """The new text and call fragments of a piece; its thinking is added to ``reasoning``."""
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.reasoning += piece.reasoning_output
        if self.parser is None:
            content, calls = piece.text_output, []
        else:
            content, calls = self.parser.feed(piece.text_output, final=bool(piece.finish_reason))
        self.text += content
        return content, calls

    def reasoning_item(self, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status, "encrypted_content": None,
                "content": [{"type": "reasoning_text", "text": self.reasoning}]}

    def message(self, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    def call_item(self, call: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def output(self) -> list[dict]:
        calls = [self.call_item(c) for c in self.parser.calls] if self.parser else []
        thought = [self.reasoning_item()] if self.reasoning else []
        return thought + ([self.message()] if self.text or not calls else []) + calls

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.store, "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": b.format.model_dump(by_alias=True, exclude_none=True) if b.format else {"type": "text"}},
            "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction) else b.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled", "usage": usage, "user": b.user, "metadata": b.metadata or {},
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"


def usage(used: Usage) -> dict:
    """Chat's usage in the Responses API's names."""
    return {"input_tokens": used.prompt_tokens, "input_tokens_details": {"cached_tokens": used.prompt_tokens_details.cached_tokens},
            "output_tokens": used.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": used.total_tokens}


async def answer_response(generations: Generations, reply: ResponseReply, store: Store, turns: list[dict], metrics,
                          route: str) -> Response:
    """Once the generation has begun (its refusal is the status): the response object, or its events.
    Stored, with ``turns`` (the conversation it answered, without instructions), when the request says
    so, once it is whole."""
    start = time.perf_counter()
    early = await generations.first()
    metrics.ttft.labels(route).observe(time.perf_counter() - start)
    if reply.body.stream:
        return StreamingResponse(_events(generations, reply, early, store, turns, metrics), media_type="text/event-stream")
    try:
        pending = early
        while True:
            for _, piece in pending:
                reply.read(piece)
            if generations.done:
                break
            pending = [await generations.next()]
    finally:
        await generations.close()
    response = reply.response(reply.status, reply.output(), usage(counted(generations, metrics)))
    _store(store, reply, response, turns)
    return JSONResponse(response)


def _store(store: Store, reply: ResponseReply, response: dict, turns: list[dict]) -> None:
    if reply.body.store:
        answered = {"role": "assistant", "content": reply.text} | (
            {"tool_calls": reply.parser.calls} if reply.parser and reply.parser.calls else {})
        store.put(response, turns + [answered])


class _Events:
    """OpenAI's typed events, numbered."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **data) -> bytes:
        event = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def _events(generations: Generations, reply: ResponseReply, early: list, store: Store, turns: list[dict],
                  metrics) -> AsyncIterator[bytes]:
    """response.created and .in_progress; a thinking model's reasoning item (output_item.added,
    content_part.added, reasoning_text.delta ..., their .done events); the message item (the same, with
    output_text.delta); each function_call item (output_item.added, function_call_arguments.delta ...,
    .done); then response.completed (or .incomplete at max_output_tokens). A failure after the first
    byte is response.failed, then an error event."""
    event, items, text_open, calls_done, thinking = _Events(), 0, False, 0, False
    try:
        yield event("response.created", response=reply.response("in_progress", [], None))
        yield event("response.in_progress", response=reply.response("in_progress", [], None))
        pending = early
        while True:
            for _, piece in pending:
                content, calls = reply.read(piece)
                if piece.reasoning_output:  # before any text or call: the thinking comes first
                    if not thinking:
                        thinking = True
                        yield event("response.output_item.added", output_index=items,
                                    item={**reply.reasoning_item("in_progress"), "content": []})
                        yield event("response.content_part.added", item_id=reply.reasoning_id, output_index=items,
                                    content_index=0, part={"type": "reasoning_text", "text": ""})
                    yield event("response.reasoning_text.delta", item_id=reply.reasoning_id, output_index=items,
                                content_index=0, delta=piece.reasoning_output)
                if thinking and (content or calls or piece.finish_reason):
                    for data in _reasoning_done(event, reply, items):
                        yield data
                    thinking, items = False, items + 1
                if content:
                    if not text_open:
                        text_open = True
                        yield event("response.output_item.added", output_index=items, item={**reply.message("in_progress"), "content": []})
                        yield event("response.content_part.added", item_id=reply.message_id, output_index=items, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    yield event("response.output_text.delta", item_id=reply.message_id, output_index=items,
                                content_index=0, delta=content, logprobs=[])
                for fragment in calls:
                    if "id" in fragment:
                        if text_open:
                            for data in _text_done(event, reply, items):
                                yield data
                            text_open, items = False, items + 1
                        elif calls_done < fragment["index"]:
                            for data in _call_done(event, reply, items, calls_done):
                                yield data
                            calls_done, items = calls_done + 1, items + 1
                        yield event("response.output_item.added", output_index=items, item=reply.call_item(
                            {**fragment, "function": {**fragment["function"], "arguments": ""}}, "in_progress"))
                    if fragment["function"]["arguments"]:
                        call = reply.parser.calls[fragment["index"]]
                        yield event("response.function_call_arguments.delta", item_id=reply.call_item(call)["id"],
                                    output_index=items, delta=fragment["function"]["arguments"])
            if generations.done:
                break
            pending = [await generations.next()]
        done = _text_done(event, reply, items) if text_open else (
            _call_done(event, reply, items, calls_done) if reply.parser and calls_done < len(reply.parser.calls) else [])
        for data in done:
            yield data
        response = reply.response(reply.status, reply.output(), usage(counted(generations, metrics)))
        _store(store, reply, response, turns)
        yield event("response.completed" if reply.status == "completed" else "response.incomplete", response=response)
    except APIError as e:
        failed = reply.response("failed", reply.output(), None) | {"error": {"code": e.code or "server_error", "message": str(e)}}
        yield event("response.failed", response=failed)
        yield event("error", code=e.code, message=str(e), param=e.param)
    except (ClientGone, asyncio.CancelledError) as gone:
        log.info("/v1/responses: the client went away during a stream; its generation is cancelled")
        if isinstance(gone, asyncio.CancelledError):
            raise
    finally:
        await generations.close()


def _text_done(event: _Events, reply: ResponseReply, index: int):
    part = reply.message()["content"][0]
    yield event("response.output_text.done", item_id=reply.message_id, output_index=index, content_index=0,
                text=reply.text, logprobs=[])
    yield event("response.content_part.done", item_id=reply.message_id, output_index=index, content_index=0, part=part)
    yield event("response.output_item.done", output_index=index, item=reply.message())


def _reasoning_done(event: _Events, reply: ResponseReply, index: int):
    item = reply.reasoning_item()
    yield event("response.reasoning_text.done", item_id=reply.reasoning_id, output_index=index, content_index=0,
                text=reply.reasoning)
    yield event("response.content_part.done", item_id=reply.reasoning_id, output_index=index, content_index=0,
                part=item["content"][0])
    yield event("response.output_item.done", output_index=index, item=item)


def _call_done(event: _Events, reply: ResponseReply, index: int, call: int):
    item = reply.call_item(reply.parser.calls[call])
    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=index, item=item)
