"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the same pipeline.

Why: the ``anthropic`` SDK and the agents built on it (Claude-Code-style tools) speak only this API. A
request becomes the same pipeline prompt a chat completion does (``system`` and the turns through the
chat template, ``tool_use`` and ``tool_result`` blocks as the template's tool calls and tool turns, tools
as function tools), and the reply comes back in Anthropic's shapes: content blocks, ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence`` with the string, ``tool_use``), usage with the prefix
cache's tokens as ``cache_read_input_tokens``, Anthropic's event sequence when streamed, and errors in
Anthropic's error object. A thinking model's thinking (contract/reasoning.py) is a ``thinking`` block
before the answer, and ``thinking`` ``enabled`` or ``disabled`` reaches the chat template as its
``enable_thinking`` (Qwen3's and SmolLM3's switch); thinking blocks sent back in assistant turns are
dropped, as those templates drop earlier turns' thinking. Fields this server does not serve are refused by
name (image and document blocks, server tools, a final assistant turn to continue); ``cache_control``
marks are accepted and need nothing: the prefix cache finds repeated prefixes by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, Field, model_validator

from client import Chunk, Prompt
from contract.tools import ToolCallParser
from openai_frontend.answer import Generations, counted
from openai_frontend.api_errors import APIError, ClientGone
from openai_frontend.schemas import FieldError, Strict, UnsupportedField, Usage as OpenAIUsage, text_only

log = logging.getLogger("openai_frontend")
STOP_REASONS = {"length": "max_tokens"}  # and stop: end_turn, stop_sequence or tool_use (MessageReply.stop_reason)


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # accepted: the prefix cache needs no marks
    citations: list | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Strict):
    """An earlier reply's thinking, sent back (as the SDK does in a tool loop): dropped, as thinking
    templates drop earlier turns' thinking. Its signature is not checked: this server signs nothing."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type"), BeforeValidator(text_only)]
THINKING = (ThinkingBlock, RedactedThinkingBlock)


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def pipeline(self, i: int) -> list[dict]:
        """The turn as preprocess takes it: a user turn's tool results become tool turns (before its text),
        an assistant turn's tool_use blocks its tool calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        calls = [b for b in self.content if isinstance(b, ToolUseBlock)]
        results = [b for b in self.content if isinstance(b, ToolResultBlock)]
        if self.role == "assistant":
            if results:
                raise FieldError(f"messages.{i}.content", f"messages.{i}.content: tool_result blocks belong in a user turn")
            return [{"role": "assistant", "content": text} | ({"tool_calls": [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in calls]} if calls else {})]
        if calls or any(isinstance(b, THINKING) for b in self.content):
            raise FieldError(f"messages.{i}.content", f"messages.{i}.content: tool_use and thinking blocks belong in an "
                             "assistant turn")
        turns = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in results]
        return turns + ([{"role": "user", "content": text}] if text or not results else [])


class CustomTool(Strict):
    name: str
    input_schema: dict
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"{data.get('type')!r} is a server tool (web search, code execution, ...), which this "
                             "server does not run; send custom tools (name, input_schema)")
        return data

    def pipeline(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "parameters": self.input_schema}
                | ({"description": self.description} if self.description else {})}


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled"]
    # Below max_tokens, as Anthropic's, which bounds thinking and answer together (no budget of its own here;
    # Anthropic's least budget, 1024, is not asked: this server's max_tokens limit may be below it).
    budget_tokens: int | None = Field(None, ge=1)

    def check(self) -> None:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise FieldError("thinking.budget_tokens", "thinking.budget_tokens is required with type enabled, and only then")


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(Strict):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict | None = None  # accepted: the prefix cache needs no marks

    def check(self) -> None:
        if self.thinking is not None:
            self.thinking.check()
        if self.messages[-1].role == "assistant":
            raise UnsupportedField(f"messages.{len(self.messages) - 1}.role", "a final assistant turn (a prefill to "
                                   "continue) is not supported by this server; end with a user turn")
        if self.tool_choice is not None and (self.tool_choice.type == "tool") != (self.tool_choice.name is not None):
            raise FieldError("tool_choice.name", "tool_choice.name is required with type tool, and only then")
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise FieldError("tool_choice", f"tool_choice {self.tool_choice.type} needs tools")
        self.conversation()  # blocks in the wrong turn

    def conversation(self) -> list[dict]:
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(b.text for b in self.system)
        turns = [{"role": "system", "content": system}] if system else []
        return turns + [turn for i, m in enumerate(self.messages) for turn in m.pipeline(i)]

    def tool_fields(self) -> dict:
        """The pipeline's ``tools``, ``tool_choice`` (``any`` is OpenAI's ``required``, a named tool its name)
        and ``parallel_tool_calls``."""
        choice = self.tool_choice
        name = None if choice is None else {"auto": "auto", "any": "required", "none": "none", "tool": choice.name}[choice.type]
        return {"tools": [t.pipeline() for t in self.tools] if self.tools else None, "tool_choice": name,
                "parallel_tool_calls": None if choice is None or choice.disable_parallel_tool_use is None
                else not choice.disable_parallel_tool_use}

    def prompt(self, **fields) -> Prompt:
        switch = None if self.thinking is None else {"enable_thinking": self.thinking.type == "enabled"}
        return Prompt(messages=self.conversation(), chat_template_kwargs=switch, **self.tool_fields(), **fields)


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None  # older clients' fields; the SDK's create sends them through extra_body
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None  # user_id: accepted and ignored, as OpenAI's user
    service_tier: Literal["auto", "standard_only"] | None = None

    def check(self) -> None:
        super().check()
        if self.thinking is not None and self.thinking.budget_tokens is not None and self.thinking.budget_tokens >= self.max_tokens:
            raise FieldError("thinking.budget_tokens", f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be "
                             f"below max_tokens ({self.max_tokens})")

    def prompt(self) -> Prompt:
        return super().prompt(max_tokens=self.max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences or [])

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")


NAMES = {"text_input": "messages", "messages": "messages", "max_tokens": "max_tokens", "temperature": "temperature",
         "top_p": "top_p", "top_k": "top_k", "stop": "stop_sequences", "tools": "tools", "tool_choice": "tool_choice",
         "chat_template_kwargs": "thinking"}


class Usage(BaseModel):
    input_tokens: int  # of the prompt, those the prefix cache did not hold (Anthropic's count)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


def usage(used: OpenAIUsage) -> Usage:
    """OpenAI's usage as Anthropic counts it: the cached prompt tokens apart from the rest."""
    cached = used.prompt_tokens_details.cached_tokens
    return Usage(input_tokens=used.prompt_tokens - cached, output_tokens=used.completion_tokens, cache_read_input_tokens=cached)


class MessageReply:
    """One generation as Anthropic's message: its text and tool calls as content blocks."""

    def __init__(self, body: MessagesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.parser = ToolCallParser() if body.calls_tools else None
        self.stop_sequence: str | None = None
        self.thinking = ""

    def read(self, piece: Chunk) -> tuple[str, list[dict]]:
        """The new text and call fragments (OpenAI's delta shape) of a piece; its thinking is added to ``thinking``."""
        if piece.stop_reason:
            self.stop_sequence = piece.stop_reason
        self.thinking += piece.reasoning_output
        if self.parser is None:
            return piece.text_output, []
        return self.parser.feed(piece.text_output, final=bool(piece.finish_reason))

    def stop_reason(self, finish_reason: str) -> str:
        """``max_tokens`` for a reply cut short (a call in it too), else ``tool_use`` for one that called
        tools, ``stop_sequence`` for one a stop string ended, ``end_turn``."""
        if finish_reason != "stop":
            return STOP_REASONS.get(finish_reason, finish_reason)
        if self.parser is not None and self.parser.calls:
            return "tool_use"
        return "stop_sequence" if self.stop_sequence else "end_turn"

    def matched(self, stop_reason: str | None) -> str | None:
        """The stop string a ``stop_sequence`` reply ended at; None for any other."""
        return self.stop_sequence if stop_reason == "stop_sequence" else None

    def header(self, content: list[dict], stop_reason: str | None, used: Usage) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": self.matched(stop_reason),
                "usage": used.model_dump()}

    def whole(self, text: str, finish_reason: str, used: Usage) -> dict:
        content = [{"type": "thinking", "thinking": self.thinking, "signature": ""}] if self.thinking else []
        content += [{"type": "text", "text": text}] if text else []
        for call in self.parser.calls if self.parser else []:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:  # a call max_tokens cut short: no input to give (stop_reason says why)
                continue
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
        return self.header(content, self.stop_reason(finish_reason), used)


async def answer_message(generations: Generations, reply: MessageReply, metrics, route: str) -> Response:
    """Once the generation has begun (its refusal is the status): the whole message, or its events."""
    start = time.perf_counter()
    early = await generations.first()
    metrics.ttft.labels(route).observe(time.perf_counter() - start)
    if reply.body.stream:
        return StreamingResponse(_events(generations, reply, early, metrics), media_type="text/event-stream")
    text, finish_reason = "", ""
    try:
        pending = early
        while True:
            for _, piece in pending:
                added, _ = reply.read(piece)
                text, finish_reason = text + added, piece.finish_reason
            if generations.done:
                break
            pending = [await generations.next()]
    finally:
        await generations.close()
    return JSONResponse(reply.whole(text, finish_reason, usage(counted(generations, metrics))))


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


async def _events(generations: Generations, reply: MessageReply, early: list, metrics) -> AsyncIterator[bytes]:
    """Anthropic's sequence: message_start, each content block's start, deltas and stop, message_delta
    (stop_reason, output tokens), message_stop; a failure after the first byte is an ``error`` event."""
    block, kind, finish_reason = -1, None, ""  # the open content block's index and type
    try:
        yield _event("message_start", {"message": reply.header([], None, usage(generations.usage()))})
        pending = early
        while True:
            for _, piece in pending:
                text, calls = reply.read(piece)
                if piece.reasoning_output:  # before any text or call: the thinking comes first
                    if kind != "thinking":
                        block, kind = block + 1, "thinking"
                        yield _event("content_block_start", {"index": block, "content_block": {
                            "type": "thinking", "thinking": "", "signature": ""}})
                    yield _event("content_block_delta", {"index": block, "delta": {
                        "type": "thinking_delta", "thinking": piece.reasoning_output}})
                if text:
                    if kind != "text":
                        if kind is not None:
                            yield _event("content_block_stop", {"index": block})
                        block, kind = block + 1, "text"
                        yield _event("content_block_start", {"index": block, "content_block": {"type": "text", "text": ""}})
                    yield _event("content_block_delta", {"index": block, "delta": {"type": "text_delta", "text": text}})
                for call in calls:
                    if "id" in call:
                        if kind is not None:
                            yield _event("content_block_stop", {"index": block})
                        block, kind = block + 1, "tool_use"
                        yield _event("content_block_start", {"index": block, "content_block": {
                            "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}})
                    if call["function"]["arguments"]:
                        yield _event("content_block_delta", {"index": block, "delta": {
                            "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
                if piece.finish_reason:
                    finish_reason = piece.finish_reason
            if generations.done:
                break
            pending = [await generations.next()]
        if kind is not None:
            yield _event("content_block_stop", {"index": block})
        used = usage(counted(generations, metrics))
        stop_reason = reply.stop_reason(finish_reason)
        yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": reply.matched(stop_reason)},
                                       "usage": {"output_tokens": used.output_tokens}})
        yield _event("message_stop", {})
    except APIError as e:
        yield _event("error", {"error": e.anthropic()["error"]})
    except (ClientGone, asyncio.CancelledError) as gone:  # seen by our watcher, or by Starlette's
        log.info("/v1/messages: the client went away during a stream; its generation is cancelled")
        if isinstance(gone, asyncio.CancelledError):
            raise
    finally:
        await generations.close()
