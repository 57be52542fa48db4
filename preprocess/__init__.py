"""Text -> token ids, with the tokenizer's chat template by default."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from contract import reasoning
from contract.errors import InvalidInput, decode_utf8
from contract.tokenizer import load_tokenizer, vocab_fingerprint
from preprocess.tools import TemplateTools, conversation, structured_outputs, tool_request


@dataclass(frozen=True)
class PreprocessConfig:
    """``preprocess`` config parameters."""

    tokenizer_dir: str
    max_input_bytes: int = 65536

    def __post_init__(self) -> None:
        if self.max_input_bytes < 1:
            raise ValueError(f"parameter 'max_input_bytes' must be >= 1, got {self.max_input_bytes}")


@dataclass(frozen=True)
class PromptRequest:
    """One client prompt as it arrives: raw bytes, checked here and nowhere else."""

    text_input: bytes | None = None
    system_prompt: bytes | None = None
    apply_chat_template: bool = True
    messages: bytes | None = None  # a whole conversation, JSON: [{"role": ..., "content": ...}, ...]
    structured_outputs: bytes | None = None  # passed on to llm (which checks it) unless tools take its place
    tools: bytes | None = None
    tool_choice: bytes | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: bytes | None = None  # JSON object: the chat template's extra variables


@dataclass(frozen=True)
class Prepared:
    """What llm gets: the prompt's ids, and what its reply must follow (JSON text; ``null`` when free);
    and where the reply begins, inside thinking or not, which comes back with every response (contract/reasoning.py)."""

    input_ids: list[int]
    structured_outputs: bytes = b"null"
    reasoning_state: str = reasoning.NONE


ROLES = ("system", "user", "assistant", "tool")
KEYS = {"system": {"content"}, "user": {"content"}, "assistant": {"content", "tool_calls"}, "tool": {"content", "tool_call_id"}}
SHAPES = {"system": "role and content", "user": "role and content", "assistant": "role and content (and tool_calls)",
          "tool": "role, content and tool_call_id"}
# What chat_template_kwargs may not set: the template call's own arguments, and what it hands the template.
RESERVED = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"} \
    | {"conversations", "messages"}


class Preprocessor:
    def __init__(self, config: PreprocessConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        self.template_tools = TemplateTools.of(self.tokenizer)
        self.thinks = reasoning.thinks(self.tokenizer.chat_template)

    def _text(self, field: str, raw: bytes, allow_empty: bool) -> str:
        limit = self.config.max_input_bytes
        if len(raw) > limit:
            raise InvalidInput(f"{field} is {len(raw)} bytes; the limit is {limit} bytes (max_input_bytes)")
        text = decode_utf8(field, raw)
        if not allow_empty and not text.strip():
            raise InvalidInput(f"{field} must not be empty")
        return text

    def encode(self, request: PromptRequest) -> Prepared:
        """Token ids for the model: a conversation (``messages``), a chat turn (user message, optional
        system prompt) or the raw text; with tools, the grammar their calls follow."""
        tools = tool_request(None if request.tools is None else self._text("tools", request.tools, allow_empty=False),
                             None if request.tool_choice is None else decode_utf8("tool_choice", request.tool_choice),
                             request.parallel_tool_calls, request.structured_outputs)
        if request.messages is not None:
            if request.text_input is not None or request.system_prompt is not None:
                raise InvalidInput("send either messages or text_input (with system_prompt), not both")
            if not request.apply_chat_template:
                raise InvalidInput("messages needs apply_chat_template=true")
            messages = self._messages(request.messages)
        elif request.text_input is None:
            raise InvalidInput("text_input is required (or messages, a whole conversation)")
        else:
            text = self._text("text_input", request.text_input, allow_empty=False)
            system = None
            if request.system_prompt is not None:
                system = self._text("system_prompt", request.system_prompt, allow_empty=True)
            if not request.apply_chat_template:
                if system:
                    raise InvalidInput("system_prompt needs apply_chat_template=true")
                if tools.active:
                    raise InvalidInput("tools needs apply_chat_template=true")
                if request.chat_template_kwargs is not None:
                    raise InvalidInput("chat_template_kwargs needs apply_chat_template=true")
                return Prepared(self.tokenizer.encode(text, add_special_tokens=True), request.structured_outputs or b"null")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        messages, shown = conversation(messages, tools, self.template_tools)
        grammar = structured_outputs(tools, self.template_tools)
        constraint = json.dumps(grammar).encode() if grammar else request.structured_outputs or b"null"
        prompt = self._chat(messages, shown, self._template_kwargs(request.chat_template_kwargs))
        state = reasoning.state_of(prompt, self.thinks)
        if state == reasoning.INSIDE and constraint.strip() != b"null":
            # A grammar holds the reply from its first token, so it cannot think first: the block is closed
            # for it, as Qwen3's template does with thinking off, and the answer follows the grammar.
            prompt, state = f"{prompt}{reasoning.CLOSE}\n\n", reasoning.OUTSIDE
        return Prepared(self.tokenizer(prompt, add_special_tokens=False)["input_ids"], constraint, state)

    def _chat(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
        """The prompt as the chat template renders it (apply_chat_template's tokenize=True encodes this
        text the same way, without special tokens); a template that refuses the request is its error."""
        if not self.tokenizer.chat_template:
            raise InvalidInput("this tokenizer has no chat template; send apply_chat_template=false")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                      **kwargs)
        except TemplateError as e:
            fields = "chat_template_kwargs and messages" if kwargs else "messages"
            raise InvalidInput(f"{fields}: the chat template refused them: {e}") from None

    def _template_kwargs(self, raw: bytes | None) -> dict:
        """``chat_template_kwargs``, checked: a JSON object whose names the template call does not take itself."""
        if raw is None:
            return {}
        try:
            kwargs = json.loads(self._text("chat_template_kwargs", raw, allow_empty=False))
        except json.JSONDecodeError as e:
            raise InvalidInput(f"chat_template_kwargs is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise InvalidInput("chat_template_kwargs must be a JSON object of the chat template's variables")
        reserved = sorted(RESERVED & set(kwargs))
        if reserved:
            raise InvalidInput(f"chat_template_kwargs may not set {reserved}: the request's own fields decide them")
        return kwargs

    def _messages(self, raw: bytes) -> list[dict]:
        """The conversation, checked: a JSON list of {"role", "content"} with known roles and text content;
        an assistant turn may hold OpenAI's ``tool_calls`` (its arguments become objects), and a ``tool``
        turn answers one by ``tool_call_id``."""
        try:
            messages = json.loads(self._text("messages", raw, allow_empty=False))
        except json.JSONDecodeError as e:
            raise InvalidInput(f"messages is not valid JSON: {e}") from None
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                role = message.get("role") if isinstance(message, dict) else None
                raise InvalidInput(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            keys = KEYS[message["role"]] | {"role"}
            needed = keys - {"tool_calls"} - ({"content"} if message.get("tool_calls") else set())  # as OpenAI's
            if not needed <= set(message) <= keys:
                raise InvalidInput(f"messages[{i}] must be an object with exactly the keys {SHAPES[message['role']]}")
            if message.get("tool_calls"):
                message["tool_calls"] = [_call(f"messages[{i}].tool_calls[{j}]", call) for j, call in enumerate(message["tool_calls"])]
                message["content"] = message.get("content") or ""
            if not isinstance(message["content"], str):
                raise InvalidInput(f"messages[{i}].content must be a string")
            if message["role"] == "tool" and not isinstance(message["tool_call_id"], str):
                raise InvalidInput(f"messages[{i}].tool_call_id must be a string")
        return messages  # a system message alone is a conversation too (OpenAI answers it)


def _call(where: str, call: object) -> dict:
    """One of an assistant turn's ``tool_calls``, its arguments parsed."""
    if not (isinstance(call, dict) and isinstance(call.get("id"), str) and call.get("type") == "function"
            and isinstance(call.get("function"), dict) and isinstance(call["function"].get("name"), str)
            and isinstance(call["function"].get("arguments"), str)):
        raise InvalidInput(f'{where} must be {{"id": "...", "type": "function", "function": {{"name": "...", "arguments": "..."}}}}')
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidInput(f"{where}.function.arguments must be a JSON object, as text")
    return {**call, "function": {**call["function"], "arguments": arguments}}
