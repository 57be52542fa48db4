"""Tool calls: the two syntaxes a reply may call tools in, the grammar that holds a reply to them, and
the parser that reads them back, whole or a piece at a time.

- ``generic``, llama.cpp's fallback for chat templates that know nothing of tools (the default SmolLM2's):
  the tools are described in a system message and the reply is one JSON object, either
  ``{"tool_calls":[{"name":...,"arguments":{...}}, ...]}`` or ``{"response":"..."}``. A grammar always
  holds the reply to that envelope (to its first form for ``required`` and a named tool), so it parses.
- ``hermes``, the syntax of templates that render ``tools`` themselves and show the model
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen 2.5 and 3, Hermes, SmolLM3): the model
  may write text, then calls. ``required`` and a named tool are held to it by a grammar; ``auto`` is left
  free, as vLLM's ``hermes`` parser leaves it.

preprocess picks the syntax from its chat template and builds the grammar; whoever reads the reply (the
OpenAI API) parses it with ``ToolCallParser``, which knows both: the generic envelope is a reply that
begins with ``{"tool_calls"`` or ``{"response"``, anything else is hermes text. Both hold a tool's arguments
to its parameters, closed to keys they do not list (``contract.grammar.closed``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from contract.grammar import closed, moved

MODES = ("none", "auto", "required")  # tool_choice's values besides the name of one tool
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOLS_LIMIT = 128  # tools one request may define (OpenAI's limit)
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
BEGIN, END = "<tool_call>", "</tool_call>"  # hermes
# hermes calls as these templates write them (Jinja's tojson); the generic envelope is compact, as
# llguidance writes JSON by default and ``envelope`` renders past calls.
HERMES_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


def check_tools(tools: Any) -> list[Tool]:
    """The ``tools`` field (OpenAI's shape: ``[{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]``) as ``Tool``s, or ``ValueError`` naming the entry and key at fault."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a JSON list of {\"type\": \"function\", \"function\": {...}} objects")
    if len(tools) > TOOLS_LIMIT:
        raise ValueError(f"tools holds {len(tools)} entries; the limit is {TOOLS_LIMIT}")
    checked: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        unknown = sorted(set(tool) - {"type", "function"}) + sorted(set(tool["function"]) - FUNCTION_KEYS)
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}")
        if name in MODES:
            raise ValueError(f"{where}.function.name must not be {name!r}: tool_choice uses that word")
        if any(t.name == name for t in checked):
            raise ValueError(f"{where}.function.name {name!r} is defined twice")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must be a JSON schema of an object")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise ValueError(f"{where}.function.strict must be true or false")
        checked.append(Tool(name, description, closed(parameters)))
    return checked


def check_choice(choice: str, tools: list[Tool]) -> str:
    """``tool_choice``: one of ``MODES`` or the name of a defined tool; ``ValueError`` otherwise."""
    if choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools")
    if choice not in MODES and all(t.name != choice for t in tools):
        names = ", ".join(t.name for t in tools) or "no tools are defined"
        raise ValueError(f"tool_choice must be none, auto, required or the name of a tool ({names}), got {choice!r}")
    return choice


def _defined(key: str) -> str:
    """Where a grammar's ``$defs`` keep ``key``'s schema: ``tools.<name>`` for a tool's parameters, ``response``
    for a direct answer's (no tool's name has a dot, so the two never meet)."""
    return f"#/$defs/{key}"


def _call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": {"$ref": _defined(f"tools.{tool.name}")}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _definitions(schemas: dict[str, dict]) -> dict:
    """The ``$defs`` that keep ``schemas`` (key -> schema): each moved there whole, its own ``$defs`` and
    ``$ref`` pointers with it, since a pointer written from the schema's root (``#/$defs/Unit``, as
    pydantic writes them) must still resolve once the schema is embedded in a grammar's."""
    return {key: moved(schema, _defined(key)) for key, schema in schemas.items()}


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _offered(tools: list[Tool], choice: str) -> list[Tool]:
    """The tools the reply may call: all of them, or the one named."""
    return [t for t in tools if choice in MODES or t.name == choice]


def _single(choice: str, parallel: bool) -> bool:
    """Whether the reply calls at most once: without parallel calls, and for a named tool (as OpenAI)."""
    return not parallel or choice not in MODES


def grammar(tools: list[Tool], choice: str, parallel: bool, syntax: str, response: dict | None = None) -> dict | None:
    """The ``structured_outputs`` that holds a reply to ``syntax`` for this choice (None: the reply is free).
    ``response``: the JSON schema a direct answer follows instead of free text (``response_format``)."""
    offered = _offered(tools, choice)
    call = _one_of([_call_schema(t) for t in offered])
    schemas = {f"tools.{t.name}": t.parameters for t in offered}
    single = _single(choice, parallel)
    if syntax == "hermes":
        if choice == "auto" and response is None:
            return None
        call = {"x-guidance": HERMES_JSON, "$defs": _definitions(schemas), **call}
        block = f'"{BEGIN}\\n" %json{json.dumps(call)} "\\n{END}"'
        repeat = "" if single else ' ("\\n" call)*'
        rules = ["start: calls", f"calls: call{repeat}", f"call: {block}"]
        if choice == "auto":  # a direct answer, held to ``response``
            answer = {"x-guidance": {"whitespace_flexible": False}, **response}
            rules[0:1] = ["start: answer | calls", f"answer: %json{json.dumps(answer)}"]
        return {"grammar": "\n".join(rules) + "\n"}
    calls = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if single else {})}
    envelope = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False}
    if choice == "auto":
        schemas["response"] = response or {"type": "string"}
        answer = {"type": "object", "properties": {"response": {"$ref": _defined("response")}}, "required": ["response"],
                  "additionalProperties": False}
        envelope = {"anyOf": [envelope, answer]}
    return {"json": {"$defs": _definitions(schemas), **envelope}}


def instructions(tools: list[Tool], choice: str, parallel: bool, response: dict | None = None) -> str:
    """The generic syntax's system message: the tools, and the reply's two forms."""
    shown = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in _offered(tools, choice)]
    calls = '{"tool_calls":[{"name":"<tool name>","arguments":{<its parameters>}}]}'
    if choice == "auto":
        answer = ('{"response":"<your reply>"}' if response is None else
                  f'{{"response":<your reply, JSON following this schema: {json.dumps(response, ensure_ascii=False)}>}}')
        form = f"Respond with one JSON object: either {calls} to call tools, or {answer} to answer the user directly."
    else:
        form = f"Respond by calling {'the tool' if choice not in MODES else 'one or more tools'} with one JSON object: {calls}"
    many = "" if _single(choice, parallel) else " You may call several tools at once."
    return f"You can call these tools:\n{json.dumps(shown, ensure_ascii=False)}\n\n{form}{many}"


def envelope(calls: list[dict]) -> str:
    """An assistant turn's calls as the generic syntax writes them (``calls``: OpenAI's ``tool_calls``,
    arguments already parsed)."""
    return json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                      for c in calls]}, ensure_ascii=False, separators=(",", ":"))


# Reading a reply, whole or growing. Everything below works on a prefix of the reply: what it returns
# never changes once returned, so a stream can send it at once.


@dataclass
class Call:
    name: str
    arguments: str  # the raw JSON text, whole or (in a growing reply) a prefix of it
    complete: bool


@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string starting at ``text[i]``, or None if it is not there whole."""
    if i >= len(text) or text[i] != '"':
        return None
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int, final: bool) -> int | None:
    """The index after the JSON value starting at ``text[i]``, or None while it is incomplete."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            if text[j] == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += text[j] in "{["
            depth -= text[j] in "}]"
            j += 1
            if depth == 0:
                return j
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) or final else None  # a number may go on while the text does


def _members(text: str, i: int, final: bool) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the JSON object at ``text[i]`` as far as they go: (key, value start, value end or
    None), and the index after its ``}`` (None while open). Malformed text ends the list."""
    members: list[tuple[str, int, int | None]] = []
    i = _ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = _ws(text, i + 1)
            continue
        key_end = _string_end(text, i)
        if key_end is None:
            break
        key, i = json.loads(text[i:key_end]), _ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            break
        start = _ws(text, i + 1)
        end = _value_end(text, start, final) if start < len(text) else None
        members.append((key, start, end))
        if end is None:
            break
        i = _ws(text, end)
    return members, None


def _call(text: str, i: int, final: bool) -> tuple[Call | None, int | None]:
    """The call object at ``text[i]``: its call once its name is whole, and the index after it."""
    members, end = _members(text, i, final)
    found = {key: (start, stop) for key, start, stop in members}
    if "name" not in found or found["name"][1] is None:
        return None, end
    name = json.loads(text[slice(*found["name"])])
    start, stop = found.get("arguments", (len(text), None))
    return Call(name, text[start:stop if stop is not None else len(text)], stop is not None), end


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}


def _string_prefix(text: str, i: int) -> str:
    """The decoded characters of the JSON string starting at ``text[i]`` that are there whole (an escape
    counts once all of it is, a surrogate pair once both halves are)."""
    out, j = [], i + 1
    while j < len(text) and text[j] != '"':
        if text[j] != "\\":
            out.append(text[j])
            j += 1
            continue
        if j + 1 >= len(text):
            break
        if text[j + 1] != "u":
            out.append(ESCAPES.get(text[j + 1], text[j + 1]))
            j += 2
            continue
        size = 12 if 0xD800 <= int(text[j + 2:j + 6].ljust(4, "0"), 16) < 0xDC00 else 6  # a pair's high half
        if j + size > len(text):
            break
        out.append(json.loads(f'"{text[j:j + size]}"'))
        j += size
    return "".join(out)


def _generic(text: str, i: int, final: bool) -> Parsed | None:
    """The generic envelope at ``text[i]``; None when the reply is not one."""
    key_at = _ws(text, i + 1)
    key_end = _string_end(text, key_at)
    if key_end is None or json.loads(text[key_at:key_end]) not in ("tool_calls", "response"):
        return None
    members, _ = _members(text, i, final)
    if not members:
        return Parsed()
    key, start, _ = members[0]
    if key == "response":  # a string's characters, or a JSON answer's text (response_format)
        if start < len(text) and text[start] == '"':
            return Parsed(content=_string_prefix(text, start))
        return Parsed(content=text[start:members[0][2] or len(text)])
    parsed = Parsed()
    j = start + 1 if start < len(text) and text[start] == "[" else len(text)
    while (j := _ws(text, j)) < len(text) and text[j] in "{,":
        if text[j] == ",":
            j += 1
            continue
        call, end = _call(text, j, final)
        if call is not None:
            parsed.calls.append(call)
        if end is None:
            break
        j = end
    return parsed


def _hermes(text: str, final: bool) -> Parsed:
    begin = text.find(BEGIN)
    if begin < 0:
        held = next((n for n in range(len(BEGIN) - 1, 0, -1) if text.endswith(BEGIN[:n])), 0) if not final else 0
        return Parsed(content=text[:len(text) - held])
    parsed = Parsed(content=text[:begin])
    while begin >= 0:
        j = _ws(text, begin + len(BEGIN))
        call, end = _call(text, j, final) if j < len(text) and text[j] == "{" else (None, None)
        if call is None:
            if final:  # a block that names no tool stays text: nothing is lost
                parsed.content += text[begin:]
            break
        parsed.calls.append(call)
        if end is None:
            break
        begin = text.find(BEGIN, end)
    return parsed


def parse(text: str, final: bool) -> Parsed:
    """The content and calls of ``text``, a whole reply (``final``) or the start of one: only what no
    later text can change (a call once its name is whole; nothing of a reply that may yet turn out to be
    the envelope; no tail that may be the start of a hermes call)."""
    start = _ws(text, 0)
    if start < len(text) and text[start] == "{":
        key_at = _ws(text, start + 1)
        if not final and _string_end(text, key_at) is None and (key_at == len(text) or text[key_at] == '"'):
            return Parsed()  # the first key is not whole yet
        envelope = _generic(text, start, final)
        if envelope is not None:
            return envelope
    return _hermes(text, final)


@dataclass
class ToolCallParser:
    """One reply's tool calls as OpenAI's deltas: feed it the text as it comes (or whole, once); each ``feed`` returns the
    new content and the new call fragments (``{"index", "id", "type", "function": {"name",
    "arguments"}}`` for a call's first, ``{"index", "function": {"arguments"}}`` after), which the official
    client joins into whole calls."""

    text: str = ""
    ids: list[str] = field(default_factory=list)  # each call's, made when its first fragment goes out
    sent_content: int = 0
    sent_arguments: list[int] = field(default_factory=list)
    parsed: Parsed = field(default_factory=Parsed)

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        self.text += piece
        self.parsed = parse(self.text, final)
        content = self.parsed.content[self.sent_content:]
        self.sent_content = len(self.parsed.content)
        deltas = []
        for index, call in enumerate(self.parsed.calls):
            if index == len(self.sent_arguments):
                self.sent_arguments.append(0)
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                deltas.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent_arguments[index]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self.sent_arguments[index]:]}})
            self.sent_arguments[index] = len(call.arguments)
        return content, deltas

    @property
    def calls(self) -> list[dict]:
        """Every call so far in a message's shape."""
        return [{"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(self.parsed.calls)]
