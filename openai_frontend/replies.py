"""How a generation is presented: OpenAI's chat and legacy completions shapes, whole and as chunks."""

from __future__ import annotations

import time
import uuid

from client import Chunk
from openai_frontend.schemas import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs, ChatMessage, Completion,
    CompletionChoice, CompletionLogprobs, CompletionRequest, GenerationFields, Usage,
)


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
