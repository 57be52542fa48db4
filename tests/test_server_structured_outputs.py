"""Structured outputs on a real server: replies valid by construction through the official ``openai``
client (``parse`` with pydantic models, ``json_object``, vLLM's ``structured_outputs``) and Triton's API."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import openai
import pytest
import requests
from pydantic import BaseModel, Field

from client import Prompt

ASK = [{"role": "user", "content": "Make up an order for a small shop, as JSON."}]


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Item(BaseModel):
    name: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=20)


class Order(BaseModel):  # nested objects, an array, an enum and an optional field
    customer: str = Field(max_length=16)
    items: list[Item] = Field(min_length=1, max_length=3)
    colour: Colour
    note: str | None = Field(None, max_length=12)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Flags(BaseModel):
    ok: bool
    tags: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


@pytest.mark.parametrize("schema", [Order, Point, Flags])
def test_parse_returns_the_pydantic_object_greedy(openai_client, model, schema):
    reply = openai_client.chat.completions.parse(model=model, messages=ASK, response_format=schema, max_tokens=300,
                                                 temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, schema)


def test_every_sampled_reply_parses_for_twenty_seeds(openai_client, model):
    def ask(seed: int):
        return openai_client.chat.completions.parse(model=model, messages=ASK, response_format=Order, max_tokens=300,
                                                    temperature=1.0, seed=seed).choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        orders = list(pool.map(ask, range(20)))
    assert all(isinstance(o, Order) for o in orders)
    assert len({o.model_dump_json() for o in orders}) > 1  # sampling still samples, inside the schema


def test_json_object_replies_are_json_objects(openai_client, model):
    """A request for a small object (an open-ended one can run on past any budget, valid but unfinished)."""
    ask = [{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}]
    for sampling in ({"temperature": 0}, {"temperature": 0.7, "seed": 1}, {"temperature": 0.7, "seed": 2}):
        reply = openai_client.chat.completions.create(model=model, messages=ask, response_format={"type": "json_object"},
                                                      max_tokens=300, **sampling)
        assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_reply_cut_by_max_tokens_ends_with_length(openai_client, model):
    reply = openai_client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                                  max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_regex_and_choice_through_structured_outputs(openai_client, model):
    regex = openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=20, temperature=0,
                                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", regex.choices[0].message.content)
    choice = openai_client.completions.create(model=model, prompt="Is the sky blue?", max_tokens=8, temperature=0.7,
                                              seed=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"


def test_triton_generate_and_grpc_streams_follow_the_same_field(generate, grpc_client):
    schema = Point.model_json_schema()
    reply = generate({"text_input": "Give me a point.", "max_tokens": 60,
                      "structured_outputs": json.dumps({"json": schema})})
    assert reply.status_code == 200, reply.text
    Point.model_validate_json(reply.json()["text_output"])
    chunks = list(grpc_client.stream(Prompt("Give me a point.", 60, structured_outputs={"json": schema})))
    assert chunks[-1].finish_reason == "stop"
    Point.model_validate_json("".join(c.text_output for c in chunks))


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}}},
     "response_format", "cannot be compiled"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required with type json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "structured_outputs.regex cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_bad_schemas_are_400s_that_name_the_field(openai_frontend, model, body, param, message):
    reply = requests.post(f"{openai_frontend.url}/v1/chat/completions", timeout=60,
                          json={"model": model, "messages": ASK, "max_tokens": 8, **body})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and message in error["message"], error


def test_the_official_client_raises_on_a_bad_schema(openai_client, model):
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        openai_client.chat.completions.create(
            model=model, messages=ASK, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}})
