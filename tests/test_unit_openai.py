"""The OpenAI front end's logic without a server: schemas, refusals, n prompts, reply shapes, keys."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from client import Chunk
from openai_frontend.__main__ import api_keys
from openai_frontend.app import _pipeline_prompts
from openai_frontend.replies import ChatReply, Choice, CompletionReply
from openai_frontend.schemas import (ChatCompletionRequest, CompletionRequest, FieldError, UnsupportedField, Usage, union_member,
                                     without_unsupported)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_types_are_strict_not_coerced():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, "max_tokens": "5"})
    assert ChatCompletionRequest.model_validate({**CHAT, "temperature": 1}).temperature == 1.0  # an int is a number


@pytest.mark.parametrize("field, value", [("functions", [{}]), ("best_of", 2), ("best_of", True),
                                          ("store", True), ("suffix", "x"), ("service_tier", "flex"), ("metadata", "x"),
                                          ("function_call", "auto")])
def test_unsupported_fields_are_named(field, value):
    with pytest.raises(UnsupportedField) as e:
        without_unsupported({**CHAT, field: value})
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


OFF = {"functions": None, "best_of": 1, "suffix": None, "store": False, "metadata": {"team": "a"},
       "service_tier": "auto", "function_call": "none", "modalities": ["text"]}


@pytest.mark.parametrize("field, value", [*OFF.items(), ("functions", [])])
def test_unsupported_fields_that_are_absent_null_or_off_are_dropped(field, value):
    assert without_unsupported({**CHAT, field: value}) == CHAT


def test_max_completion_tokens_is_the_budget_and_must_agree_with_max_tokens():
    assert ChatCompletionRequest.model_validate({**CHAT, "max_completion_tokens": 7}).budget == 7
    with pytest.raises(FieldError, match="disagree") as e:
        ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 6, "max_completion_tokens": 7}).check()
    assert e.value.field == "max_completion_tokens"


@pytest.mark.parametrize("top_logprobs", [0, 2])
def test_top_logprobs_needs_logprobs(top_logprobs):
    with pytest.raises(FieldError, match="logprobs=true") as e:
        ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": top_logprobs}).check()
    assert e.value.field == "top_logprobs"
    ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": top_logprobs, "logprobs": True}).check()


def test_developer_messages_and_text_parts_reach_the_template_as_system_and_text():
    body = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert body.conversation() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]


def test_n_prompts_are_seeded_seed_and_up_and_temperature_defaults_to_one():
    body = ChatCompletionRequest.model_validate({**CHAT, "n": 3, "seed": 10, "stop": "x"})
    prompts = _pipeline_prompts(body, {"messages": body.conversation()}, body.n)
    assert [p.seed for p in prompts] == [10, 11, 12] and {p.temperature for p in prompts} == {1.0}
    assert prompts[0].stop == ["x"] and prompts[0].messages == [{"role": "user", "content": "hi"}]
    unseeded = _pipeline_prompts(ChatCompletionRequest.model_validate({**CHAT, "temperature": 0}), {}, 2)
    assert [p.seed for p in unseeded] == [None, None] and unseeded[0].temperature == 0


def test_stream_options_need_stream():
    with pytest.raises(FieldError, match="stream=true") as e:
        ChatCompletionRequest.model_validate({**CHAT, "stream_options": {"include_usage": True}}).check()
    assert e.value.field == "stream_options"


ITEM = {"token": " Paris", "bytes": list(b" Paris"), "logprob": -0.25,
        "top_logprobs": [{"token": " Paris", "bytes": list(b" Paris"), "logprob": -0.25}]}


def test_chat_chunks_leave_out_what_a_delta_lacks_and_usage_unless_asked():
    reply = ChatReply(ChatCompletionRequest.model_validate({**CHAT, "stream": True, "logprobs": True}), "m")
    first = reply.chunk(0, Chunk(" Paris", 1, 5, "", [ITEM]), first=True)
    later = reply.chunk(0, Chunk(".", 2, 5, "stop", []), first=False)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": " Paris"} and "usage" not in first
    assert later["choices"][0]["delta"] == {"content": "."} and later["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25


def test_completion_logprobs_take_the_legacy_shape_with_text_offsets():
    reply = CompletionReply(CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 1}), "m")
    dot = {**ITEM, "token": ".", "bytes": [46], "logprob": -0.5, "top_logprobs": []}
    whole = reply.whole([Choice(" Paris.", "", "stop", [ITEM, dot])], Usage.of(5, 2, 0))
    logprobs = whole["choices"][0]["logprobs"]
    assert logprobs == {"tokens": [" Paris", "."], "token_logprobs": [-0.25, -0.5],
                        "top_logprobs": [{" Paris": -0.25}, {}], "text_offset": [0, 6]}
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 0}}


def test_error_locations_drop_union_member_names():
    assert [p for p in ("messages", 0, "content", "list[ContentPart]", 0, "type") if not union_member(p)] == \
        ["messages", 0, "content", 0, "type"]


def test_api_keys_come_from_the_variable_and_the_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfile-key\n\n")
    assert api_keys(" a, b ,", str(keys)) == {"a", "b", "file-key"}
    assert api_keys("", "") == frozenset()


def test_a_body_nested_too_deeply_is_a_client_error():
    """Found by the fuzz test: json.loads raises RecursionError, which was a 500."""
    import asyncio

    from openai_frontend.app import Settings, _parse
    from openai_frontend.api_errors import APIError

    class Body:  # what _parse reads of a Request
        headers: dict = {}

        async def stream(self):
            yield b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"

    with pytest.raises(APIError, match="nested too deeply") as e:
        asyncio.run(_parse(Body(), ChatCompletionRequest, Settings()))
    assert e.value.status == 400


@pytest.mark.parametrize("message, status, code", [
    ("overloaded: 256 requests are already waiting for room in the KV budget (max_queued_requests=256); retry later", 503, "overloaded"),
    ("Exceeds maximum queue size", 503, "overloaded"),
    ("internal error: generation failed: boom", 500, "internal"),
    ("in ensemble 'ensemble', max_tokens must be in [1, 512], got 0", 400, None),
    ("unavailable: the server is stopping and takes no new requests; retry", 503, "unavailable"),
])
def test_pipeline_errors_keep_their_message_and_get_openai_statuses(message, status, code):
    from tritonclient.utils import InferenceServerException

    from openai_frontend.api_errors import APIError
    from openai_frontend.pipeline import _error

    error = APIError.of(_error(InferenceServerException(msg=message)), {})
    response = error.response()
    assert (error.status, error.code) == (status, code) and not str(error).startswith("in ensemble")
    assert response.headers.get("Retry-After") == ("1" if status == 503 else None)
    assert json.loads(response.body)["error"]["type"] in ("invalid_request_error", "server_error", "service_unavailable")


@pytest.mark.parametrize("message, names, expected, param", [
    ("text_input is 2097152 bytes; the limit is 1048576 bytes (max_input_bytes)", {"text_input": "prompt"},
     "prompt is 2097152 bytes; the limit is 1048576 bytes (max_input_bytes)", "prompt"),
    ("max_tokens must be in [1, 512], got 600", {"max_tokens": "max_completion_tokens"},
     "max_completion_tokens must be in [1, 512], got 600", "max_completion_tokens"),
    ("messages[0].role must be one of system, user, assistant, got 'x'", {"messages": "messages"},
     "messages[0].role must be one of system, user, assistant, got 'x'", "messages"),
    ("the tokenizer has no chat template", {"text_input": "prompt"}, "the tokenizer has no chat template", None),
])
def test_pipeline_errors_name_the_field_the_client_sent(message, names, expected, param):
    from tritonclient.utils import InferenceServerException

    from openai_frontend.api_errors import APIError
    from openai_frontend.pipeline import _error

    error = APIError.of(_error(InferenceServerException(msg=f"in ensemble 'ensemble', {message}")), names)
    assert (str(error), error.param) == (expected, param)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("tools, text", [
    ([TOOL], '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'),
    ([TOOL], '{"response":"It is sunny."}'),
    ([TOOL], '{"response":""}'),
    ([TOOL], 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ([], "It is sunny."),
    ([], ""),
])
def test_a_stream_joins_into_the_whole_replys_message(tools, text):
    """The official client's stream helper assembles the chunks into the message the whole reply has:
    ``content`` None beside calls, "" for an empty reply, the text otherwise."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    body = {**CHAT, "tools": tools} if tools else CHAT
    whole = ChatReply(ChatCompletionRequest.model_validate(body), "m").whole([Choice(text, "", "stop")], Usage.of(1, 1, 0))
    reply, state = ChatReply(ChatCompletionRequest.model_validate({**body, "stream": True}), "m"), ChatCompletionStreamState()
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        data = reply.chunk(0, Chunk(piece, i + 1, 1, "stop" if last else ""), first=i == 0)
        if data is not None:
            state.handle_chunk(ChatCompletionChunk.model_validate(data))
    assembled = state.get_final_completion().choices[0]
    expected = whole["choices"][0]
    assert assembled.message.content == expected["message"]["content"] and assembled.finish_reason == expected["finish_reason"]
    calls = [(c.function.name, c.function.arguments) for c in assembled.message.tool_calls or []]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in expected["message"].get("tool_calls", [])]
    assert calls or expected["message"]["content"] is not None  # content is null only beside calls


@pytest.mark.parametrize("schema, body, param, kind", [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0", "image_url"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0", "input_image"),
    ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0", "image"),
])
def test_a_part_that_is_not_text_is_refused_as_such_on_every_api(schema, body, param, kind):
    import asyncio

    from openai_frontend.api_errors import APIError
    from openai_frontend.app import Settings, _parse
    from openai_frontend.messages import MessagesRequest
    from openai_frontend.responses import ResponsesRequest

    class Body:  # what _parse reads of a Request
        headers: dict = {}

        async def stream(self):
            yield json.dumps({"model": "m", **body}).encode()

    schemas = {"chat": ChatCompletionRequest, "responses": ResponsesRequest, "messages": MessagesRequest}
    with pytest.raises(APIError) as e:
        asyncio.run(_parse(Body(), schemas[schema], Settings(model_name="m"), openai=schema != "messages"))
    assert e.value.status == 400 and e.value.param == param and f"this model takes text only; a content part of type '{kind}'" in str(e.value)


def test_an_integer_logit_bias_stays_an_integer():
    body = ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"7": -150, "8": 2.5}})
    assert body.passed()["logit_bias"] == {"7": -150, "8": 2.5} and isinstance(body.passed()["logit_bias"]["7"], int)
