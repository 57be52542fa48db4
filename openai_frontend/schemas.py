"""OpenAI's request and response bodies, as far as this server implements them.

Requests are strict: a wrong type is the client's error (``"max_tokens": "5"`` is refused, not coerced),
and every field OpenAI defines that this server does not do is refused by name (``UNSUPPORTED``) instead
of being silently ignored (its absent, null and "off" values are accepted). Ranges are not checked here: the pipeline checks them and its messages reach
the client unchanged, so the limits live in one place (contract/schema.py and llm's config). The fields
passed on as they are come from contract/schema.py (``PASSED``): OpenAI's sampling fields and the
extensions vLLM accepts beside them (``top_k``, ``repetition_penalty``, ``ignore_eos``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic_core import PydanticCustomError

from contract.schema import REQUEST

MAX_N = 8  # choices per request: each is a generation of its own in llm's batch


def _absent(value: object) -> bool:
    return value is None or value == [] or value == {}


# OpenAI fields this server does not implement: which of their values mean "off" (accepted, then
# dropped, as OpenAI's own defaults must be), and why any other value is refused.
UNSUPPORTED: dict[str, tuple[Callable[[object], bool], str]] = {
    "functions": (_absent, "the deprecated functions field is not supported by this server; use tools"),
    "function_call": (lambda v: v is None or v == "none", "the deprecated function_call field is not supported by this server; use tool_choice"),
    "audio": (_absent, "audio output is not supported by this server"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported by this server"),
    "prediction": (_absent, "predicted outputs are not supported by this server"),
    "web_search_options": (_absent, "web search is not supported by this server"),
    "reasoning_effort": (_absent, "reasoning effort is not supported by this server; a thinking chat template thinks as "
                         'it is told through chat_template_kwargs (e.g. {"enable_thinking": false})'),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service tier is served"),
    "store": (lambda v: v is None or v is False, "stored completions are not supported by this server"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "must be an object"),  # tags for stored completions
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "best_of above 1 is not supported by this server; use n"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported by this server"),
}


class FieldError(Exception):
    """A field of the request is at fault; the message names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedField(FieldError):
    """A field OpenAI defines that this server refuses rather than ignores."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(field, f"{field}: {why}")


def without_unsupported(body: dict) -> dict:
    """``body`` without the OpenAI fields this server does not do that are absent, null or off; raises
    ``UnsupportedField`` naming the first one that is on."""
    for name, (off, why) in UNSUPPORTED.items():
        if name in body and not off(body[name]):
            raise UnsupportedField(name, why)
    return {k: v for k, v in body.items() if k not in UNSUPPORTED}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk (guidellm asks for it)


def union_member(part: str | int) -> bool:
    """pydantic names the member of a union a location went through (``str``, ``list[ContentPart]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def most_specific(error: ValidationError, within: tuple[str | int, ...] = ()) -> tuple[str | None, str]:
    """The field and message of pydantic's most specific error (a union reports each member's; on a tie
    its list form), its location under ``within`` and without the member names."""
    best = max(error.errors(), key=lambda err: (len(err["loc"]), any("[" in str(p) for p in err["loc"])))
    return ".".join(str(part) for part in (*within, *best["loc"]) if not union_member(part)) or None, best["msg"]


# Content parts of OpenAI's and Anthropic's APIs that are not text: a text-only model refuses them by saying
# so, not by naming the text part's type it expected.
MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "input_audio", "audio", "input_file", "file", "document"})


def text_only(part: object) -> object:
    """``part`` unchanged, unless it is an image, audio or file part: then an error that names its type."""
    if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
        raise PydanticCustomError("text_only", "this model takes text only; a content part of type '{type}' "
                                  "cannot be read", {"type": part["type"]})
    return part


class ContentPart(Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: object) -> object:
        return text_only(part)


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall
    index: int | None = Field(None, exclude=True)  # what a streamed call carries; taken back, and ignored


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def pipeline(self) -> dict:
        """The message as preprocess takes it (``developer`` is OpenAI's newer name for ``system``)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the arguments always follow the parameters here, strict or not


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def pipeline(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Strict):
    name: str
    schema_: dict | None = Field(None, alias="schema")  # ``schema`` would shadow pydantic's own attribute
    strict: bool | None = None  # the reply always follows the schema here, strict or not
    description: str | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> dict | None:
        """The pipeline's ``structured_outputs`` for this format (None for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise FieldError("response_format.json_schema", "response_format.json_schema is required with type json_schema")
            return {"json": self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"}}
        return None


# The request fields of contract/schema.py that the OpenAI API takes by the same name and passes on as
# they are (OpenAI's own, and the extensions vLLM accepts beside them); the rest are mapped by hand.
PASSED = tuple(f for f in REQUEST if f.openai)
PassedFields = create_model("PassedFields", __base__=Strict, **{f.name: (f.python_type | None, None) for f in PASSED})


class GenerationFields(PassedFields):
    """What both endpoints take."""

    model: str
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    user: str | None = None  # accepted and ignored, as OpenAI uses it only for abuse monitoring

    def passed(self) -> dict:
        """The pass-through fields the client set, by their pipeline names."""
        return {f.name: getattr(self, f.name) for f in PASSED if getattr(self, f.name) is not None}

    def check(self) -> None:
        """What the field types cannot say; raises ``FieldError``."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(GenerationFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id is None:
                raise FieldError(f"messages.{i}.tool_call_id", f"messages.{i}.tool_call_id is required in a tool message")
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise FieldError(f"messages.{i}.content", f"messages.{i}.content is required unless an assistant message has tool_calls")
            if message.tool_calls and message.role != "assistant":
                raise FieldError(f"messages.{i}.tool_calls", f"messages.{i}.tool_calls is only allowed in an assistant message")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs is only allowed with logprobs=true")
        if self.response_format is not None:
            self.response_format.structured_outputs()  # a json_schema format without its json_schema is refused
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs is not None:
            raise FieldError("structured_outputs", "send response_format or structured_outputs, not both")

    def structured(self) -> dict | None:
        """What constrains the reply: ``response_format`` (OpenAI's), else ``structured_outputs`` (vLLM's)."""
        format = self.response_format.structured_outputs() if self.response_format is not None else None
        return format if format is not None else self.structured_outputs

    @property
    def structured_name(self) -> str:
        """The field the client constrained the reply with, for messages."""
        return "response_format" if self.response_format is not None and self.response_format.type != "text" else "structured_outputs"

    @property
    def budget_name(self) -> str:
        """The field the client set its reply budget with, for messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        return [m.pipeline() for m in self.messages]

    def tool_fields(self) -> dict:
        """The pipeline's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (a named choice by its name)."""
        choice = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return {"tools": [t.pipeline() for t in self.tools] if self.tools else None, "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls}

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may hold tool calls (and so is parsed for them)."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(GenerationFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_N)]  # token-id prompts are refused
    logprobs: int | None = None  # the legacy API's: how many top alternatives, 0 to 5
    echo: bool = False  # the prompt before the reply, in the text and (with logprobs) the prompt's logprobs

    @property
    def budget(self) -> int | None:
        return self.max_tokens

    @property
    def budget_name(self) -> str:
        return "max_tokens"

    def check(self) -> None:
        super().check()
        if self.chat_template_kwargs is not None:
            raise UnsupportedField("chat_template_kwargs", "a completion's prompt is raw text, which no chat template "
                                   "renders; send it to /v1/chat/completions")

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # the prompt tokens the prefix cache saved, as OpenAI and vLLM report them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# Responses. Built once per reply or chunk; ``exclude_none`` is not used, so absent values are JSON null
# as OpenAI sends them.


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a thinking model's thinking (vLLM's and SGLang's name), never in content
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ObjectHeader(BaseModel):
    """What every completion object and chunk starts with."""

    id: str
    created: int
    model: str


class ChatCompletion(ObjectHeader):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None  # fragments: contract/tools.py's ToolCallParser


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ObjectHeader):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions API's shape: parallel lists, and top alternatives as token -> logprob."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token: nothing comes before it
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(ObjectHeader):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triton-chat"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Error(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: Error
