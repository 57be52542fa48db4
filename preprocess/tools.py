"""Tools in the prompt: what the chat template does with them, and a conversation with tool calls and
tool results as that template takes it (contract/tools.py has the syntaxes and says which is which)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from contract import tools as syntax
from contract.errors import InvalidInput
from contract.grammar import closed, llguidance_grammar

PROBE = "probe_tool_5d41402a"  # a tool name no template writes unless it renders the tools it is given


@dataclass(frozen=True)
class TemplateTools:
    """Whether the chat template renders ``tools`` (``native``), and the syntax its replies call them in:
    ``hermes`` where the template shows ``<tool_call>``, else ``generic`` (a grammar-held JSON envelope)."""

    native: bool
    syntax: str

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> "TemplateTools":
        probe = [{"type": "function", "function": {"name": PROBE, "description": "", "parameters": {"type": "object"}}}]
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception:  # a template that fails on tools does not render them
            text = ""
        native = PROBE in text
        return cls(native, "hermes" if native and syntax.BEGIN in str(tokenizer.chat_template) else "generic")

    def __str__(self) -> str:
        shown = "rendered by the chat template" if self.native else "described in a system message"
        return f"tools {shown}, their calls in the {self.syntax} syntax"


@dataclass(frozen=True)
class ToolRequest:
    """A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked."""

    tools: tuple[syntax.Tool, ...]
    raw: tuple[dict, ...]  # as the client sent them, for templates that render tools
    choice: str
    parallel: bool
    response: dict | None = None  # the schema a direct answer follows (structured_outputs with tools)

    @property
    def active(self) -> bool:
        """Whether the model is shown the tools and may call them."""
        return bool(self.tools) and self.choice != "none"


def tool_request(tools: str | None, choice: str | None, parallel: bool, structured_outputs: bytes | None = None) -> ToolRequest:
    """The request's tool fields, or ``InvalidInput`` naming the field at fault. With tools on, the
    request's ``structured_outputs`` (a JSON schema or ``json_object``) is what a direct answer follows."""
    try:
        raw = json.loads(tools) if tools is not None else []
    except json.JSONDecodeError as e:
        raise InvalidInput(f"tools is not valid JSON: {e}") from None
    try:
        checked = syntax.check_tools(raw)
        choice = syntax.check_choice("auto" if choice is None else choice, checked)
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    for i, tool in enumerate(checked):
        _compilable(f"tools[{i}].function.parameters", json.dumps({"json": tool.parameters}, sort_keys=True))
    request = ToolRequest(tuple(checked), tuple(raw), choice, parallel)
    if not request.active or structured_outputs is None:
        return request  # structured_outputs, if any, goes to llm as it is
    return replace(request, response=_answer_schema(structured_outputs, choice))


def _answer_schema(structured_outputs: bytes, choice: str) -> dict:
    """The schema a direct answer follows beside active tools: ``structured_outputs``' ``json`` (or any
    object for ``json_object``), closed; any other kind is refused, naming the field."""
    try:
        spec = json.loads(structured_outputs)
        schema = spec.get("json", {"type": "object"}) if isinstance(spec, dict) and set(spec) in ({"json"}, {"json_object"}) else None
        schema = json.loads(schema) if isinstance(schema, str) else schema
    except ValueError:  # not JSON, or not UTF-8
        schema = None
    if not isinstance(schema, dict):
        raise InvalidInput(f"structured_outputs with tools (tool_choice {choice}) must be a JSON schema (an object) or "
                           "json_object: a direct answer follows it; send tool_choice none for any other")
    _compilable("structured_outputs.json", json.dumps({"json": schema}, sort_keys=True))
    return closed(schema)


@lru_cache(maxsize=256)
def _compilable(where: str, spec: str) -> None:
    """A grammar llguidance cannot compile (``spec``: ``structured_outputs`` as JSON text) is the client's
    error, named here as the field it came from rather than as llm's ``structured_outputs``."""
    try:
        llguidance_grammar(json.loads(spec))
    except InvalidInput as e:
        raise InvalidInput(f"{where} {re.sub(r'^structured_outputs[.][a-z_]+ ', '', str(e))}") from None


def conversation(messages: list[dict], request: ToolRequest, template: TemplateTools) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to render: a template that renders tools gets them and the calls as they
    are (arguments as objects, as Hugging Face templates expect); for any other, calls become the
    generic envelope, tool results user turns, and the tools a system message (llama.cpp's polyfill)."""
    names: dict[str, str] = {}
    rendered = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        names |= {call["id"]: call["function"]["name"] for call in calls}
        if message["role"] == "tool" and message["tool_call_id"] not in names:
            raise InvalidInput(f"messages[{i}].tool_call_id {message['tool_call_id']!r} answers no earlier tool call")
        if template.native:
            rendered.append(message | ({"name": names[message["tool_call_id"]]} if message["role"] == "tool" else {}))
        elif calls:
            rendered.append({"role": "assistant", "content": syntax.envelope(calls)})
        elif message["role"] == "tool":
            response = {"name": names[message["tool_call_id"]], "content": message["content"]}
            rendered.append({"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)})
        else:
            rendered.append(message)
    if request.active and template.syntax == "generic":
        text = syntax.instructions(list(request.tools), request.choice, request.parallel, request.response)
        if rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{text}"}
        else:
            rendered.insert(0, {"role": "system", "content": text})
    return rendered, list(request.raw) if request.active and template.native else None


def structured_outputs(request: ToolRequest, template: TemplateTools) -> dict | None:
    """The grammar the reply follows, or None (no tools, ``none``, or hermes ``auto`` without an answer schema).
    Each schema in it compiled alone already; this checks them together, so no error names a field the
    client never sent."""
    if not request.active:
        return None
    spec = syntax.grammar(list(request.tools), request.choice, request.parallel, template.syntax, request.response)
    if spec is not None:
        _compilable("tools", json.dumps(spec, sort_keys=True))
    return spec
