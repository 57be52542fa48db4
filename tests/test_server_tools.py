"""Tool calling on a real server through the official ``openai`` client: every ``tool_choice``, streamed and
not, a two-turn round trip, parallel calls, bad definitions, Triton's own API, and a chat template that
renders tools itself (the hermes syntax) swapped into preprocess."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Literal, Optional

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from client import Prompt
from client.admin import swap_tokenizer

ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
HERMES_TEMPLATE = Path(__file__).parent / "templates" / "hermes.jinja"


class GetWeather(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Weather(BaseModel):
    """An Enum: the client writes the parameters with ``$defs`` and ``$ref``."""
    city: str = Field(max_length=20)
    unit: Unit


class Place(BaseModel):
    city: str = Field(max_length=20)
    country: Optional[str] = Field(max_length=20)


class Trip(BaseModel):
    """A nested model, an Optional one and a list of models."""
    origin: Place
    destination: Optional[Place]
    stops: list[Place] = Field(max_length=2)


DEFS_TOOLS = [openai.pydantic_function_tool(Weather, name="weather", description="The current weather in a city"),
              openai.pydantic_function_tool(Trip, name="plan_trip", description="Plan a trip between cities")]
TRIP_ASK = [{"role": "user", "content": "Plan a trip from Paris to Rome, and tell me the weather in Rome in celsius."}]
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"]}
TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather", description="The current weather in a city"),
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME,
                                           "strict": True}}]
SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"], "get_time": TIME,
           **{t["function"]["name"]: t["function"]["parameters"] for t in DEFS_TOOLS}}  # with their $defs


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


def valid_calls(message) -> list:
    """The message's calls, each checked: an id, a defined tool, arguments valid against its parameters."""
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls or []


def streamed(client: openai.OpenAI, **request):
    """The completion the official client assembles from the stream's deltas."""
    with client.chat.completions.stream(**request) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_calls_a_tool_with_valid_arguments(openai_client, model, stream):
    request = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(valid_calls(choice.message)) >= 1
    assert not choice.message.content


def test_streamed_and_whole_replies_carry_the_same_calls(openai_client, model):
    request = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    whole = openai_client.chat.completions.create(**request).choices[0].message.tool_calls
    assembled = streamed(openai_client, **request).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(c.function.name, c.function.arguments) for c in assembled]
    assert isinstance(assembled[0].function.parsed_arguments, GetWeather)  # the client parsed the streamed arguments


def test_required_holds_for_twenty_sampled_seeds(openai_client, model):
    def ask(seed: int):
        return openai_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                     max_tokens=120, temperature=1.0, seed=seed).choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(20)))
    for choice in choices:
        assert choice.finish_reason == "tool_calls" and valid_calls(choice.message)
    assert len({c.message.tool_calls[0].function.arguments for c in choices}) > 1  # sampling still samples


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_is_the_one_called_once(openai_client, model, stream):
    request = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.create(**request)
    calls = valid_calls(reply.choices[0].message)
    assert [c.function.name for c in calls] == ["get_time"] and reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tools, ask", [(TOOLS, ASK), (DEFS_TOOLS, TRIP_ASK)], ids=["literal", "defs-and-refs"])
def test_auto_answers_or_calls_and_either_is_well_formed(openai_client, model, stream, tools, ask):
    for seed in range(3):
        request = dict(model=model, messages=ask, tools=tools, max_tokens=160, temperature=1.0, seed=seed)
        reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.create(**request)
        well_formed(reply.choices[0])


def well_formed(choice) -> None:
    """An ``auto`` reply, whichever the model chose: calls (``content`` null), or text without the envelope."""
    if valid_calls(choice.message):
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    else:
        assert choice.message.content and "tool_calls" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")


CHOICES = ["required", {"type": "function", "function": {"name": "weather"}}, {"type": "function", "function": {"name": "plan_trip"}}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named-enum", "named-nested"])
def test_tools_with_defs_and_refs_are_called_with_valid_arguments(openai_client, model, stream, choice):
    """``pydantic_function_tool`` over an Enum or nested models writes ``$defs``/``$ref``: the calls follow
    the tool's own schema, and the client parses them into the models, whole and streamed."""
    request = dict(model=model, messages=TRIP_ASK, tools=DEFS_TOOLS, tool_choice=choice, max_tokens=160, temperature=0)
    reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.parse(**request)
    choice_ = reply.choices[0]
    calls = valid_calls(choice_.message)
    assert calls and choice_.finish_reason == "tool_calls" and choice_.message.content is None
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == [choice["function"]["name"]]
    models = {"weather": Weather, "plan_trip": Trip}
    assert all(isinstance(c.function.parsed_arguments, models[c.function.name]) for c in calls)


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    sunny: bool


def test_a_direct_answer_follows_response_format_beside_the_tools(openai_client, model):
    """OpenAI takes both: the reply calls tools, or answers in the schema (``parse`` reads either)."""
    kinds = set()
    for seed in range(6):
        choice = openai_client.chat.completions.parse(
            model=model, messages=ASK, tools=TOOLS, response_format=Forecast, max_tokens=120, temperature=1.0,
            seed=seed).choices[0]
        if valid_calls(choice.message):
            kinds.add("calls")
            assert choice.finish_reason == "tool_calls"
        else:
            kinds.add("answer")
            assert isinstance(choice.message.parsed, Forecast) and choice.finish_reason == "stop"
    assert kinds  # which of the two the model picks is its own; each is well-formed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_none_answers_in_text(openai_client, model, stream):
    request = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0)
    reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.message.content and not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("tools, ask", [(TOOLS, [{"role": "user", "content": "Weather in Paris, Rome, Oslo and Lima?"}]),
                                        (DEFS_TOOLS, TRIP_ASK)], ids=["literal", "defs-and-refs"])
def test_parallel_tool_calls_false_allows_one_call(openai_client, model, tools, ask):
    for seed in range(4):
        calls = valid_calls(openai_client.chat.completions.create(
            model=model, messages=ask, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=160,
            temperature=1.0, seed=seed).choices[0].message)
        assert len(calls) == 1


def test_a_tool_round_trip_call_result_answer(openai_client, model, http_url, tokenizer):
    first = openai_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=80, temperature=0).choices[0].message
    call = valid_calls(first)[0]
    result = json.dumps({"temperature": 18, "sky": "sunny"})
    conversation = ASK + [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = openai_client.chat.completions.create(model=model, messages=conversation, tools=TOOLS, tool_choice="none",
                                                  max_tokens=40, temperature=0)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    # The call and its result reached the model through the chat template.
    rendered = rendered_prompt(http_url, tokenizer, conversation)
    assert call.function.name in rendered and "temperature" in rendered and "sunny" in rendered


def rendered_prompt(http_url: str, tokenizer, messages: list[dict], **fields) -> str:
    """The prompt preprocess builds for ``messages``, as text (its ids, decoded)."""
    inputs = [{"name": "messages", "shape": [1, 1], "datatype": "BYTES", "data": [json.dumps(messages)]}]
    inputs += [{"name": k, "shape": [1, 1], "datatype": "BYTES", "data": [v]} for k, v in fields.items()]
    reply = requests.post(f"{http_url}/v2/models/preprocess/infer", json={"inputs": inputs}, timeout=30)
    assert reply.status_code == 200, reply.text
    ids = next(o for o in reply.json()["outputs"] if o["name"] == "input_ids")["data"]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools",
     "tools[0].function.name must be 1 to 64 letters, digits, _ or -"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type", "Input should be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?=x)"}}}}}]}, "tools", "tools[0].function.parameters cannot be compiled"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/Unit"}}}}}]}, "tools", "tools[0].function.parameters cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice must be none, auto, required or the name of a tool (get_weather, get_time), got 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Input should be"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs",
     "structured_outputs with tools (tool_choice auto) must be a JSON schema (an object) or json_object"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "18"}]}, "messages",
     "messages[0].tool_call_id 'call_x' answers no earlier tool call"),
    ({"messages": [{"role": "tool", "content": "18"}]}, "messages.0.tool_call_id", "is required in a tool message"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(openai_frontend, model, body, param, message):
    reply = requests.post(f"{openai_frontend.url}/v1/chat/completions", timeout=60,
                          json={"model": model, "messages": ASK, "max_tokens": 8, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("tools, ask, named", [(TOOLS, ASK, "get_weather"), (DEFS_TOOLS, TRIP_ASK, "plan_trip")],
                         ids=["literal", "defs-and-refs"])
def test_triton_generate_and_grpc_take_the_same_fields(generate, grpc_client, tools, ask, named):
    """Triton's API reaches the same tools: the reply is the envelope, which contract.tools parses."""
    from contract.tools import parse

    reply = generate({"text_input": ask[0]["content"], "max_tokens": 160, "tools": json.dumps(tools), "tool_choice": named})
    assert reply.status_code == 200, reply.text
    calls = parse(reply.json()["text_output"], final=True).calls
    assert [c.name for c in calls] == [named]
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[named])
    chunks = list(grpc_client.stream(Prompt(ask[0]["content"], 160, tools=tools, tool_choice="required")))
    calls = parse("".join(c.text_output for c in chunks), final=True).calls
    assert calls and chunks[-1].finish_reason == "stop"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    refused = generate({"text_input": "hi", "max_tokens": 8, "tools": json.dumps(tools), "tool_choice": "nope"})
    assert refused.status_code == 400 and "tool_choice must be none, auto, required" in refused.json()["error"]


@pytest.fixture
def hermes_preprocess(server, grpc_url, model_dir, tokenizer_copy):
    """preprocess with a chat template that renders tools and shows the hermes syntax (Qwen 2.5's kind)."""
    folder = tokenizer_copy("hermes")
    shutil.copy2(HERMES_TEMPLATE, folder / "chat_template.jinja")
    swap_tokenizer(grpc_url, str(folder), ("preprocess",), server.admin_key)
    yield
    swap_tokenizer(grpc_url, str(model_dir), ("preprocess",), server.admin_key)


def test_a_template_with_tools_renders_them_and_its_calls_parse(hermes_preprocess, openai_client, model, http_url,
                                                                tokenizer):
    rendered = rendered_prompt(http_url, tokenizer, ASK, tools=json.dumps(TOOLS))
    assert "<tools>" in rendered and "get_weather" in rendered and "You can call these tools" not in rendered
    for stream in (False, True):
        request = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
        reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.create(**request)
        assert reply.choices[0].finish_reason == "tool_calls" and valid_calls(reply.choices[0].message)
    for stream in (False, True):
        for choice in CHOICES:
            request = dict(model=model, messages=TRIP_ASK, tools=DEFS_TOOLS, tool_choice=choice, max_tokens=160, temperature=0)
            reply = streamed(openai_client, **request) if stream else openai_client.chat.completions.create(**request)
            assert reply.choices[0].finish_reason == "tool_calls" and valid_calls(reply.choices[0].message)
            assert reply.choices[0].message.content is None
    auto = openai_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    choice = auto.choices[0]  # free in the hermes syntax: text, or calls that parse
    assert valid_calls(choice.message) or (choice.message.content and "<tool_call>" not in choice.message.content)
