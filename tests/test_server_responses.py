"""OpenAI's Responses API on a real tritonserver, through the official ``openai`` client unchanged: whole
and streamed responses in OpenAI's event order, ``responses.parse`` with a pydantic model, a function
tool round trip (by ``previous_response_id`` and by items), the bounded store, and errors that name the
field. Properties only: never what the 135M model happens to say."""

from __future__ import annotations

import openai
import pytest
import requests

from conftest import Colour, Weather

GREEDY = {"temperature": 0.0}
STORY = "Tell me a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


def count(frontend, messages: list[dict], **extra) -> int:
    return requests.post(f"{frontend.url}/tokenize", json={"messages": messages, **extra}, timeout=60).json()["count"]


def test_a_response_is_openais_object_with_its_usage(openai_client, openai_frontend, model):
    response = openai_client.responses.create(model=model, input=STORY, instructions="Answer briefly.",
                                              max_output_tokens=24, **GREEDY)
    assert response.object == "response" and response.output_text and response.output[0].type == "message"
    assert response.status in ("completed", "incomplete")
    assert (response.status == "incomplete") == (response.usage.output_tokens == 24)
    assert response.usage.input_tokens == count(openai_frontend, [{"role": "system", "content": "Answer briefly."},
                                                                  {"role": "user", "content": STORY}])
    short = openai_client.responses.create(model=model, input=STORY, max_output_tokens=3, **GREEDY)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_a_stream_has_openais_events_in_order_and_adds_up_to_the_response(openai_client, model):
    whole = openai_client.responses.create(model=model, input=STORY, max_output_tokens=20, store=False, **GREEDY)
    events = list(openai_client.responses.create(model=model, input=STORY, max_output_tokens=20, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    with openai_client.responses.stream(model=model, input=STORY, max_output_tokens=20, **GREEDY) as stream:
        last = list(stream)[-1]  # response.completed, or response.incomplete (get_final_response wants the former)
    assert last.response.output_text == whole.output_text and last.response.status == whole.status


def test_parse_fills_a_pydantic_model(openai_client, model):
    response = openai_client.responses.parse(model=model, input="Describe the colour of the sun.", text_format=Colour,
                                             max_output_tokens=64)
    assert isinstance(response.output_parsed, Colour)


@pytest.mark.parametrize("by", ["previous_response_id", "items"])
def test_a_function_tool_round_trip_reaches_the_model(openai_client, openai_frontend, model, by):
    tools = [openai.pydantic_function_tool(Weather)]
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in tools]
    first = openai_client.responses.create(model=model, input="What is the weather in Paris?", tools=tools,
                                           tool_choice="required", max_output_tokens=64, **GREEDY)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(Weather.model_validate_json(c.arguments) for c in calls)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 degrees and sunny"} for c in calls]
    if by == "previous_response_id":
        second = openai_client.responses.create(model=model, previous_response_id=first.id, input=outputs, tools=tools,
                                                max_output_tokens=24, **GREEDY)
        assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    else:
        items = [{"role": "user", "content": "What is the weather in Paris?"}, *[c.to_dict() for c in calls], *outputs]
        second = openai_client.responses.create(model=model, input=items, tools=tools, max_output_tokens=24, **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens and second.output


def test_the_store_keeps_gets_and_forgets(openai_client, openai_frontend, model):
    kept = openai_client.responses.create(model=model, input="Hi", max_output_tokens=4)
    assert openai_client.responses.retrieve(kept.id).output_text == kept.output_text
    openai_client.responses.delete(kept.id)
    for response_id in (kept.id, openai_client.responses.create(model=model, input="Hi", max_output_tokens=4, store=False).id):
        with pytest.raises(openai.NotFoundError) as e:
            openai_client.responses.retrieve(response_id)
        assert response_id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.responses.create(model=model, input="Hi", previous_response_id="resp_gone")
    assert e.value.body["param"] == "previous_response_id"


def test_what_is_not_served_is_refused_by_name(openai_frontend, model):
    def error_of(body: dict) -> dict:
        reply = requests.post(f"{openai_frontend.url}/v1/responses", json={"model": model, **body}, timeout=60)
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]

    assert error_of({"input": "Hi", "tools": [{"type": "web_search"}]})["param"] == "tools.0"
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    assert error_of({"input": [image]})["param"].startswith("input.0.content")
    assert error_of({"input": [{"type": "web_search_call", "id": "ws_1"}]})["param"] == "input.0.type"
    assert error_of({"input": "Hi", "reasoning": {"effort": "high"}})["param"] == "reasoning"
    assert error_of({"input": "Hi", "background": True})["param"] == "background"
    assert error_of({"input": "Hi", "max_output_tokens": 100_000})["param"] == "max_output_tokens"
    assert error_of({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}})["param"] == "text.format.schema"
