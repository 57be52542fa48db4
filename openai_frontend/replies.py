"""How a generation is presented: OpenAI's chat and legacy completions shapes, whole and as chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from client import Chunk
from contract.tools import ToolCallParser
from openai_frontend.schemas import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatLogprobs,
    ChatMessage, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, GenerationFields, Usage,
)


@dataclass
class Choice:
    """One generation, whole: its answer, its thinking (a thinking model's), why it ended, its tokens' logprobs."""

    text: str = ""
    reasoning: str = ""
    finish_reason: str = ""
    logprobs: list[dict] | None = None

    def add(self, piece: Chunk) -> None:
        self.text += piece.text_output
        self.reasoning += piece.reasoning_output
        self.finish_reason = piece.finish_reason
        if piece.token_logprobs is not None:  # after the prompt's, when echoed (the first piece)
            self.logprobs = (self.logprobs or []) + (piece.prompt_token_logprobs or []) + piece.token_logprobs


class Reply:
    """One API's way to present generations: the chat or the legacy completions shape."""

    def __init__(self, body: GenerationFields, model: str) -> None:
        self.body, self.model = body, model
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    prefix = ""

    def chunk(self, index: int, piece: Chunk, first: bool) -> dict | None:
        """The chunk a piece makes, or None when it shows nothing yet."""

    def whole(self, choices: list[Choice], usage: Usage) -> dict: ...

    def usage_chunk(self, usage: Usage) -> dict: ...

class ChatReply(Reply):
    prefix = "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, model: str) -> None:
        super().__init__(body, model)
        self.parsers: dict[int, ToolCallParser] = {}  # each choice's, when the reply may call tools

    def _logprobs(self, items: list[dict] | None) -> ChatLogprobs | None:
        return ChatLogprobs(content=items or []) if self.body.logprobs else None

    def _read(self, index: int, text: str, finish_reason: str) -> tuple[str, list[dict], str]:
        """The new content and call fragments of choice ``index``, and its finish reason (``tool_calls``
        for a reply that called tools and ended by itself)."""
        if not self.body.calls_tools:
            return text, [], finish_reason
        parser = self.parsers.setdefault(index, ToolCallParser())
        content, calls = parser.feed(text, final=bool(finish_reason))
        return content, calls, "tool_calls" if finish_reason == "stop" and parser.parsed.calls else finish_reason

    def chunk(self, index: int, piece: Chunk, first: bool) -> dict | None:
        content, calls, reason = self._read(index, piece.text_output, piece.finish_reason)
        thinking = piece.reasoning_output or None
        if not (first or content or calls or reason or piece.token_logprobs or thinking):
            return None  # text held back: it may be the start of a tool call
        delta = ChatDelta(role="assistant" if first else None, content=content or self._empty(index, first, reason),
                          reasoning_content=thinking, tool_calls=calls or None)
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(piece.token_logprobs),
                                 finish_reason=reason or None)
        data = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump(
            exclude=None if self.body.include_usage else {"usage"})
        data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # OpenAI leaves out what a delta lacks
        return data

    def _empty(self, index: int, first: bool, reason: str) -> str | None:
        """``""`` where a delta without text still shows the message's content, else None: so the stream
        joins into the whole reply's message. A text reply's content is ``""`` from its first chunk on (as
        OpenAI streams it); one that may call tools has none (``null``) until it shows text, and ``""``
        only once it ended with neither text nor calls."""
        if not self.body.calls_tools:
            return "" if first else None
        parsed = self.parsers[index].parsed
        return "" if reason and not (parsed.content or parsed.calls) else None

    def whole(self, choices, usage):
        data = ChatCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            self._choice(i, choice) for i, choice in enumerate(choices)]).model_dump()
        for choice in data["choices"]:
            for name in ("tool_calls", "reasoning_content"):  # sent only when the reply has them, as OpenAI and vLLM do
                if choice["message"][name] is None:
                    del choice["message"][name]
        return data

    def _choice(self, index: int, choice: Choice) -> ChatChoice:
        content, _, reason = self._read(index, choice.text, choice.finish_reason)
        calls = self.parsers[index].calls if index in self.parsers else []
        message = ChatMessage(content=None if calls and not content else content, tool_calls=calls or None,
                              reasoning_content=choice.reasoning or None)
        return ChatChoice(index=index, message=message, logprobs=self._logprobs(choice.logprobs), finish_reason=reason)

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
            CompletionChoice(index=i, text=self._echo(i) + c.text, logprobs=self._logprobs(i, c.logprobs),
                             finish_reason=c.finish_reason)
            for i, c in enumerate(choices)
        ]).model_dump()

    def usage_chunk(self, usage):
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage).model_dump()
