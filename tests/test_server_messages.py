"""Anthropic's Messages API on a real tritonserver, through the official ``anthropic`` client unchanged:
whole and streamed replies, stop reasons, usage against count_tokens, a tool round trip, and errors in
Anthropic's shape that name the field. Properties only: never what the 135M model happens to say."""

from __future__ import annotations

import anthropic
import pytest
import requests

from conftest import Weather

STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
GREEDY = {"extra_body": {"temperature": 0.0}}  # the SDK's create has no sampling fields; older clients send them
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": Weather.model_json_schema()}


@pytest.fixture(scope="module")
def client(openai_frontend) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=openai_frontend.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


def test_a_message_is_anthropics_shape_with_its_usage_and_stop_reason(client, model):
    message = client.messages.create(model=model, max_tokens=24, system="Answer briefly.", messages=STORY, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == model
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert (message.stop_reason == "max_tokens") == (message.usage.output_tokens == 24)
    counted = client.messages.count_tokens(model=model, system="Answer briefly.", messages=STORY).input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    short = client.messages.create(model=model, max_tokens=3, messages=STORY, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_a_stop_sequence_ends_the_reply_and_is_named(client, model):
    whole = client.messages.create(model=model, max_tokens=40, messages=STORY, **GREEDY).content[0].text
    stop = " " + whole.split()[len(whole.split()) // 2]
    message = client.messages.create(model=model, max_tokens=40, messages=STORY, stop_sequences=["zzz-never", stop], **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == whole[: whole.index(stop)]


def test_a_stream_is_anthropics_event_sequence_and_adds_up_to_the_whole_message(client, model, openai_frontend):
    whole = client.messages.create(model=model, max_tokens=20, messages=STORY, **GREEDY)
    with client.messages.stream(model=model, max_tokens=20, messages=STORY, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    reply = requests.post(f"{openai_frontend.url}/v1/messages", timeout=120, stream=True, json={
        "model": model, "max_tokens": 8, "messages": STORY, "stream": True})
    events = [line.split(": ", 1)[1] for line in reply.iter_lines(decode_unicode=True) if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1] == "content_block_start" and events[-3] == "content_block_stop"
    assert set(events[2:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_reaches_the_model(client, model, stream):
    """tool_choice any forces a call (the grammar makes it valid): a tool_use block whose input validates;
    its tool_result, sent back as the SDK builds it, is in the next prompt, which the model answers."""
    ask = dict(model=model, max_tokens=64, tools=[WEATHER_TOOL], tool_choice={"type": "any"}, **GREEDY,
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls and all(c.name == "get_weather" and Weather.model_validate(c.input) for c in calls)
    turns = ask["messages"] + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id,
                                                             "content": "18 degrees and sunny"} for c in calls]}]
    answer = client.messages.create(**{**ask, "tool_choice": {"type": "auto"}, "messages": turns})
    counted = client.messages.count_tokens(model=model, messages=turns, tools=[WEATHER_TOOL]).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    assert counted > message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_bad_input_is_anthropics_error_naming_the_field(client, model, openai_frontend):
    def error_of(body: dict, status: int = 400) -> dict:
        reply = requests.post(f"{openai_frontend.url}/v1/messages", json=body, timeout=120)
        assert reply.status_code == status, reply.text
        data = reply.json()
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
        return data["error"]

    base = {"model": model, "max_tokens": 4, "messages": STORY}
    assert "max_tokens" in error_of({"model": model, "messages": STORY})["message"]
    assert error_of({**base, "max_tokens": 100_000})["message"].startswith("max_tokens must be")
    assert error_of({**base, "model": "claude-sonnet-4-5"}, 404)["type"] == "not_found_error"
    assert error_of({**base, "thinking": {"type": "adaptive"}})["message"].startswith("thinking.type:")
    assert error_of({**base, "thinking": {"type": "enabled", "budget_tokens": 4}})["message"].startswith("thinking.budget_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert "messages.0.content" in error_of({**base, "messages": [{"role": "user", "content": [image]}]})["message"]
    message = error_of({**base, "tools": [{"type": "web_search_20250305", "name": "web_search"}]})["message"]
    assert message.startswith("tools.0: ") and "server tool" in message
    assert error_of({**base, "temperature": 5.0})["message"].startswith("temperature")
    prefill = STORY + [{"role": "assistant", "content": "Once"}]
    assert "final assistant turn" in error_of({**base, "messages": prefill})["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK raises Anthropic's error types from it
        client.messages.create(model=model, max_tokens=4, messages=STORY, tool_choice={"type": "tool", "name": "nope"},
                               tools=[WEATHER_TOOL])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "tool_choice" in e.value.body["error"]["message"]
