"""Tool calls without a server: the syntaxes' parser (whole and streamed at every split), the checks of
tool definitions, and the prompt each kind of chat template gets (contract/tools.py, preprocess/tools.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import with_template
from contract.errors import InvalidInput
from contract.tools import ToolCallParser, check_tools, parse
from preprocess import PreprocessConfig, Preprocessor, PromptRequest

HERMES_TEMPLATE = Path(__file__).parent / "templates" / "hermes.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
              "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]

REPLIES = [  # (reply, content, [(name, arguments)])
    ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Pa\\"ris","n":[1,{"a":"}"}]}},{"name":"x","arguments":{}}]}',
     "", [("get_weather", '{"city":"Pa\\"ris","n":[1,{"a":"}"}]}'), ("x", "{}")]),
    ('{"response":"Hi\\n\\u00e9t\\u00e9 \\ud83d\\ude00 \\\\o/"}', "Hi\nété 😀 \\o/", []),
    ('{"response":{"a":[1,"}"],"b":null}}', '{"a":[1,"}"],"b":null}', []),  # an answer held to response_format
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
     "Sure.\n", [("f", '{"a": 1}'), ("g", "{}")]),
    ("a < b and <tool is not a call", "a < b and <tool is not a call", []),
    ('{"other": 1} is JSON, not the envelope', '{"other": 1} is JSON, not the envelope', []),
    ("{not json", "{not json", []),
    ('Hm <tool_call>\n{"nam": 1}\n</tool_call>', 'Hm <tool_call>\n{"nam": 1}\n</tool_call>', []),  # no tool named: text
]


@pytest.mark.parametrize("reply, content, calls", REPLIES)
def test_a_whole_reply_parses_into_content_and_calls(reply, content, calls):
    parsed = parse(reply, final=True)
    assert parsed.content == content and [(c.name, c.arguments) for c in parsed.calls] == calls
    assert all(c.complete for c in parsed.calls)


@pytest.mark.parametrize("reply, content, calls", REPLIES)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_fragments_join_into_the_whole_reply_at_any_split(reply, content, calls, step):
    """What a stream sent is never taken back: content and argument fragments join into the whole reply's,
    and each call's first fragment (with its id and whole name) comes once."""
    parser, streamed, assembled = ToolCallParser(), "", {}
    for start in range(0, len(reply), step):
        text, deltas = parser.feed(reply[start:start + step], final=start + step >= len(reply))
        streamed += text
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] not in assembled and delta["type"] == "function"
                assembled[delta["index"]] = [delta["function"]["name"], ""]
            assembled[delta["index"]][1] += delta["function"]["arguments"]
    assert streamed == content and [tuple(assembled[i]) for i in sorted(assembled)] == calls
    assert [c["id"] for c in parser.calls] == parser.ids and len(set(parser.ids)) == len(calls)


def test_a_reply_cut_inside_a_call_keeps_what_came():
    parsed = parse('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Pa', final=True)
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [("get_weather", '{"city":"Pa', False)]
    assert parse('{"tool_calls":[{"na', final=False).calls == [] and parse("<tool_c", final=False).content == ""


@pytest.mark.parametrize("tools, message", [
    ({"type": "function"}, "tools must be a JSON list"),
    ([{"type": "code", "function": {"name": "f"}}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "bad name"}}], r"tools\[0\].function.name must be 1 to 64 letters"),
    ([{"type": "function", "function": {"name": "auto"}}], r"must not be 'auto'"),
    ([WEATHER, WEATHER], r"tools\[1\].function.name 'get_weather' is defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "must be a JSON schema of an object"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}], r"unknown keys \['returns'\]"),
])
def test_bad_tool_definitions_name_the_entry(tools, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools)


@pytest.fixture(scope="module")
def generic(model_dir) -> Preprocessor:
    return Preprocessor(PreprocessConfig(str(model_dir)))


@pytest.fixture(scope="module")
def hermes(model_dir, tmp_path_factory) -> Preprocessor:
    return Preprocessor(PreprocessConfig(str(with_template(model_dir, tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE))))


def prompt(preprocessor: Preprocessor, messages: list[dict], **fields) -> tuple[str, dict | None]:
    prepared = preprocessor.encode(PromptRequest(messages=json.dumps(messages).encode(), **{
        k: v if isinstance(v, bool) else (v if isinstance(v, str) else json.dumps(v)).encode() for k, v in fields.items()}))
    return preprocessor.tokenizer.decode(prepared.input_ids), json.loads(prepared.structured_outputs)


def test_a_template_without_tools_gets_them_described_and_calls_as_the_envelope(generic):
    assert (generic.template_tools.native, generic.template_tools.syntax) == (False, "generic")
    text, grammar = prompt(generic, CALLED, tools=[WEATHER])
    assert "You can call these tools" in text and '"name": "get_weather"' in text
    assert '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}' in text  # the past call
    assert '{"tool_response": {"name": "get_weather", "content": "18 C and sunny"}}' in text  # its result, a user turn
    assert set(grammar) == {"json"} and len(grammar["json"]["anyOf"]) == 2  # auto: a call or a response
    assert "tool_calls" in prompt(generic, CALLED, tools=[WEATHER], tool_choice="required")[1]["json"]["properties"]
    text, grammar = prompt(generic, CALLED, tools=[WEATHER], tool_choice="none")
    assert grammar is None and "You can call these tools" not in text and "18 C and sunny" in text


def test_a_template_that_renders_tools_gets_them_and_its_own_syntax(hermes):
    assert (hermes.template_tools.native, hermes.template_tools.syntax) == (True, "hermes")
    text, grammar = prompt(hermes, CALLED, tools=[WEATHER])
    assert "<tools>" in text and '"name": "get_weather"' in text and "You can call these tools" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    assert grammar is None  # auto is free in the hermes syntax
    grammar = prompt(hermes, CALLED, tools=[WEATHER], tool_choice="get_weather")[1]
    assert set(grammar) == {"grammar"} and "<tool_call>" in grammar["grammar"]


@pytest.mark.parametrize("fields, messages, message", [
    ({"tools": [WEATHER], "tool_choice": "get_time"}, None, "tool_choice must be none, auto, required or the name of a tool"),
    ({"tool_choice": "required"}, None, "tool_choice 'required' needs tools"),
    ({"tools": "[{"}, None, "tools is not valid JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}}}]},
     None, r"tools\[0\].function.parameters cannot be compiled"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "$defs": {"Unit": {"enum": ["c", "f"]}}}}}]},
     None, r"tools\[0\].function.parameters cannot be compiled: .*Missing"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/unit.json"}}}}}]},
     None, r"tools\[1\].function.parameters cannot be compiled: .*https://example.com/unit.json"),
    ({"tools": [WEATHER], "structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}}},
     None, "structured_outputs.json cannot be compiled: .*B"),
    ({"tools": [WEATHER], "structured_outputs": {"regex": "a+"}}, None,
     r"structured_outputs with tools \(tool_choice auto\) must be a JSON schema"),
    ({"tools": [WEATHER], "structured_outputs": {"json": {"type": "string", "pattern": "(?=a)"}}}, None,
     "structured_outputs.json cannot be compiled"),
    ({}, [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], r"messages\[0\].tool_call_id 'call_9' answers no earlier tool call"),
    ({}, [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}], r"messages\[0\].tool_calls\[0\].function.arguments must be a JSON object"),
    ({}, [{"role": "tool", "content": "x"}], r"messages\[0\] must be an object with exactly the keys role, content and tool_call_id"),
])
def test_bad_tool_requests_name_the_field(generic, fields, messages, message):
    with pytest.raises(InvalidInput, match=message):
        prompt(generic, messages or [{"role": "user", "content": "hi"}], **fields)


def test_a_direct_answer_follows_the_requests_schema_beside_the_tools(generic, hermes):
    answer = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    text, grammar = prompt(generic, CALLED, tools=[WEATHER], structured_outputs={"json": answer})
    assert grammar["json"]["$defs"]["response"] == {**answer, "additionalProperties": False}
    assert '"summary"' in text  # the system message shows the answer's schema
    grammar = prompt(hermes, CALLED, tools=[WEATHER], structured_outputs={"json_object": True})[1]
    assert grammar["grammar"].startswith("start: answer | calls")  # hermes auto is held once an answer has a schema
    assert prompt(generic, CALLED, tools=[WEATHER], tool_choice="none", structured_outputs={"regex": "a+"})[1] == {"regex": "a+"}


def test_tools_need_the_chat_template(generic):
    with pytest.raises(InvalidInput, match="tools needs apply_chat_template=true"):
        generic.encode(PromptRequest(b"hi", apply_chat_template=False, tools=json.dumps([WEATHER]).encode()))
