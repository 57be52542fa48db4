"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, answered by the pipeline itself.

Why: clients count tokens before they send (to fit a context, to budget ``max_tokens``), and a count is
only right if it is the pipeline's. So ``/tokenize`` asks ``preprocess`` for the very ids a generation
would start from (its tokenizer, its chat template, its tool rendering): ``count`` equals the
``usage.prompt_tokens`` of the same prompt sent to ``/v1/completions``, or of the same messages sent to
``/v1/chat/completions``. ``/detokenize`` asks ``postprocess`` for the text of ids as a whole reply (special
tokens left out, as every reply shows them). A tokenizer swapped into the pipeline is the one both use.

The pipeline tokenizes one way per endpoint, so the options that would count otherwise are refused by
name rather than answered with a count no generation would match: ``add_special_tokens`` is true for a
prompt and false for messages, ``add_generation_prompt`` true, ``continue_final_message`` false;
``return_token_strs`` is refused too (this process holds no tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from client import Prompt
from openai_frontend.schemas import ChatTool, FieldError, Message, Strict, UnsupportedField

MAX_DETOKENIZE_TOKENS = 131072
TOKEN_ID = Annotated[int, Field(ge=0, lt=2**31)]


class TokenizeFields(Strict):
    model: str | None = None  # optional, as vLLM's; when given, the model this server serves
    return_token_strs: bool | None = False

    def check(self) -> None:
        if self.return_token_strs:
            raise UnsupportedField("return_token_strs", "token strings are not served (this front end holds no "
                                   "tokenizer); POST /detokenize turns ids back into text")

    def _pipeline_value(self, name: str, value: bool, why: str) -> None:
        if getattr(self, name) != value:
            raise UnsupportedField(name, f"must be {str(value).lower()}: {why}, and /tokenize counts what it runs")


class TokenizeCompletionRequest(TokenizeFields):
    prompt: str
    add_special_tokens: bool = True

    def check(self) -> None:
        super().check()
        self._pipeline_value("add_special_tokens", True, "the pipeline encodes a prompt with its special tokens")

    def prompt_of(self) -> Prompt:
        return Prompt(text_input=self.prompt, apply_chat_template=False)


class TokenizeChatRequest(TokenizeFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict | None = None  # as the chat request's: the template's variables, e.g. enable_thinking

    def check(self) -> None:
        super().check()
        for name, value in (("add_generation_prompt", True), ("continue_final_message", False), ("add_special_tokens", False)):
            self._pipeline_value(name, value, "the pipeline applies the chat template with the generation prompt")

    def prompt_of(self) -> Prompt:
        return Prompt(messages=[m.pipeline() for m in self.messages],
                      tools=[t.pipeline() for t in self.tools] if self.tools else None,
                      chat_template_kwargs=self.chat_template_kwargs)


def tokenize_schema(data: dict) -> type[TokenizeFields]:
    """vLLM's two request shapes, told apart by ``messages``."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None  # the model's context (MAX_MODEL_LEN, or its config.json), when this process knows it
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TOKEN_ID]

    def check(self) -> None:
        if len(self.tokens) > MAX_DETOKENIZE_TOKENS:
            raise FieldError("tokens", f"tokens holds {len(self.tokens)} ids; the limit is {MAX_DETOKENIZE_TOKENS}")


class DetokenizeResponse(BaseModel):
    prompt: str


def model_context(model_dir: str | None) -> int | None:
    """The context llm allows the model in ``model_dir`` (its ``max_position_embeddings``), if readable."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])
    except (TypeError, OSError, ValueError, KeyError):
        return None
