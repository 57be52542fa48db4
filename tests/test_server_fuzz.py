"""Property-based fuzzing of generate, infer, gRPC and the OpenAI API against the running server (hypothesis).

Every answer is a clear client error or a valid reply; no instance dies; the server answers normally
afterwards. FUZZ_EXAMPLES sets the cases per protocol (CI runs the default).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings, strategies as st
from tritonclient.utils import InferenceServerException

from ipc.stubs import stubs

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TEXT = st.one_of(st.text(max_size=64), st.just(""), st.just("x" * 70_000), st.just("\U0001F600" * 20))
# Valid budgets stay tiny so the cases run fast; the rest is out of range or of the wrong type.
MAX_TOKENS = st.one_of(st.integers(1, 3), st.integers(-2**63, 0), st.integers(513, 2**63), st.floats(), st.text(max_size=4))
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70), st.booleans(), st.none())
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                    max_leaves=12)
BODY = st.fixed_dictionaries(
    {"max_tokens": MAX_TOKENS},
    optional={
        "text_input": st.one_of(TEXT, JUNK),
        "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER, "repetition_penalty": NUMBER, "seed": NUMBER,
        "stop": st.one_of(st.lists(st.text(max_size=6), max_size=12), st.just(["a"] * 5000), st.just(["x" * 500]), JUNK),
        "ignore_eos": st.one_of(st.booleans(), JUNK), "apply_chat_template": st.one_of(st.booleans(), JUNK),
        "system_prompt": st.one_of(TEXT, JUNK), "unknown_field": JUNK,
    },
)


@pytest.fixture(scope="module")
def llm_stubs(server):
    before = stubs(server.process.pid)
    yield
    assert stubs(server.process.pid) == before, "a model instance died"
    assert requests.post(f"{server.url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2},
                         timeout=60).status_code == 200


def check(status: int, text: str) -> None:
    data = json.loads(text)
    # Triton 2.51's HTTP front end answers 500 for JSON it cannot parse, or a value it cannot convert to
    # the input's type ({"max_tokens": 0.0}); its message is clear and no model sees the request.
    triton_parse = status == 500 and data.get("error", "").startswith(("Unable to parse", "failed to parse"))
    assert status in (200, 400) or triton_parse, (status, text[:300])
    if triton_parse:
        return
    if status == 400:
        assert isinstance(data["error"], str) and len(data["error"]) > 8, data
    else:
        assert isinstance(data["text_output"], str) and data["finish_reason"] in ("stop", "length")


@FUZZ
@given(body=BODY, raw=st.sampled_from(["json", "nan", "bad utf-8", "deep"]))
def test_generate_answers_every_body_with_a_reply_or_a_clear_error(http_url, llm_stubs, body, raw):
    data = json.dumps(body).encode()  # Python writes NaN and Infinity, which JSON does not allow
    if raw == "bad utf-8":
        data = b'{"text_input": "\xff\xfe", ' + data[1:]
    elif raw == "deep":
        data = b'{"text_input": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    reply = requests.post(f"{http_url}/v2/models/ensemble/generate", data=data, timeout=120)
    check(reply.status_code, reply.text)


SHAPES = st.sampled_from([[1, 1], [2, 1], [1, 3], [0, 1], [1, 0]])


@FUZZ
@given(text=TEXT, max_tokens=st.one_of(st.integers(1, 3), st.integers(-2**31, 0), st.integers(513, 2**31 - 1)),
       shape=SHAPES, datatype=st.sampled_from(["BYTES", "INT32", "FP32"]))
def test_infer_answers_every_tensor_with_a_reply_or_a_clear_error(http_url, llm_stubs, text, max_tokens, shape, datatype):
    count = math.prod(shape)
    values = [text] * count if datatype == "BYTES" else [1] * count
    request = {"inputs": [{"name": "text_input", "shape": shape, "datatype": datatype, "data": values},
                          {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [max_tokens]}]}
    reply = requests.post(f"{http_url}/v2/models/ensemble_infer/infer", json=request, timeout=120)
    assert reply.status_code in (200, 400), reply.text[:300]
    data = reply.json()
    assert ("error" in data and len(data["error"]) > 8) or {o["name"] for o in data["outputs"]} >= {"text_output"}


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), st.just(b"\xc3"), st.just(b"x" * 70_000)),
       max_tokens=st.one_of(st.integers(1, 3), st.integers(-2**31, 0), st.integers(513, 2**31 - 1)),
       temperature=st.floats(width=32), rows=st.integers(1, 2))
def test_grpc_answers_every_request_with_a_reply_or_a_clear_error(server, llm_stubs, raw, max_tokens, temperature, rows):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    inputs = []
    for name, array, dtype in (("text_input", np.array([[raw]] * rows, dtype=np.object_), "BYTES"),
                               ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                               ("temperature", np.array([[temperature]], dtype=np.float32), "FP32")):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    try:
        result = client.infer("ensemble_infer", inputs, client_timeout=120)
        assert result.as_numpy("text_output") is not None
    except InferenceServerException as e:
        assert e.status() in ("StatusCode.INVALID_ARGUMENT",) and len(e.message()) > 8, (e.status(), e.message())
    finally:
        client.close()


MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": TEXT}),
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["tool", "function", "robot"]), JUNK), "content": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), TEXT), "tool_calls": st.one_of(st.lists(
        st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]), "type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]), "arguments": st.one_of(st.just('{"a": 1}'), TEXT)})}), max_size=2), JUNK)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.one_of(st.sampled_from(["c1", "c9"]), JUNK),
                           "content": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), JUNK), max_size=3)}),
    JUNK,
)
TOOL = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["f", "g", "auto", "x y", ""]), TEXT)},
    optional={"description": st.one_of(TEXT, JUNK), "parameters": st.one_of(
        st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        st.dictionaries(st.sampled_from(["type", "properties", "required", "x"]), JUNK, max_size=3), JUNK)})}), JUNK)
TEMPLATE_KWARGS = st.one_of(st.dictionaries(st.sampled_from(["enable_thinking", "tools", "messages", "x"]), JUNK, max_size=2), JUNK)
CHAT = st.fixed_dictionaries(
    {"max_tokens": MAX_TOKENS, "messages": st.one_of(st.lists(MESSAGE, max_size=4), JUNK)},
    optional={
        "model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=8), JUNK),
        "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER, "seed": NUMBER, "n": st.one_of(st.integers(-1, 10), JUNK),
        "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "repetition_penalty": NUMBER,
        "stop": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=6), max_size=12), JUNK),
        "stream": st.one_of(st.booleans(), JUNK), "stream_options": st.one_of(st.just({"include_usage": True}), JUNK),
        "logprobs": st.one_of(st.booleans(), JUNK), "top_logprobs": st.one_of(st.integers(-1, 7), JUNK),
        "max_completion_tokens": MAX_TOKENS, "ignore_eos": st.one_of(st.booleans(), JUNK),
        "tools": st.one_of(st.lists(TOOL, max_size=3), JUNK),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "x y"])})}), JUNK),
        "parallel_tool_calls": st.one_of(st.booleans(), JUNK),
        "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), st.fixed_dictionaries(
            {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": st.one_of(
                st.just({"type": "object", "properties": {"a": {"type": "integer"}}}), st.dictionaries(TEXT, JUNK, max_size=3))})}),
            JUNK),
        "structured_outputs": st.one_of(st.fixed_dictionaries({"regex": TEXT}), st.fixed_dictionaries({"choice": st.lists(TEXT, max_size=3)}),
                                        st.dictionaries(st.sampled_from(["json", "json_object", "regex", "choice", "grammar", "x"]), JUNK, max_size=2), JUNK),
        "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-5, 60000).map(str), TEXT), NUMBER, max_size=4), JUNK),
        "min_p": NUMBER, "min_tokens": st.one_of(st.integers(-2, 600), JUNK),
        "stop_token_ids": st.one_of(st.lists(st.integers(-5, 60000), max_size=4), JUNK),
        "user": st.one_of(st.text(max_size=8), JUNK), "unknown_field": JUNK, "chat_template_kwargs": TEMPLATE_KWARGS,
    },
)


def check_openai(status: int, content_type: str, text: str) -> None:
    """A chat completion, a stream of chunks that ends with [DONE], or an OpenAI error object; no 5xx."""
    assert status in (200, 400, 404), (status, text[:300])
    if status != 200:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) > 8, error
        return
    if content_type.startswith("text/event-stream"):
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            data = json.loads(event[len("data: "):])
            assert data["object"] == "chat.completion.chunk", data
        return
    data = json.loads(text)
    assert data["object"] == "chat.completion" and all(c["finish_reason"] in ("stop", "length") for c in data["choices"])


@FUZZ
@given(body=CHAT, raw=st.sampled_from(["json", "nan", "bad utf-8", "deep", "not json"]))
def test_the_openai_api_answers_every_body_with_a_reply_or_an_openai_error(openai_frontend, llm_stubs, body, raw):
    if isinstance(body.get("messages"), list) and body.get("model") is None:
        body["model"] = "SmolLM2-135M-Instruct"
    data = json.dumps(body).encode()
    if raw == "bad utf-8":
        data = b'{"messages": "\xff\xfe", ' + data[1:]
    elif raw == "deep":
        data = b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    elif raw == "not json":
        data = data[: len(data) // 2]
    reply = requests.post(f"{openai_frontend.url}/v1/chat/completions", data=data, timeout=120,
                          headers={"Content-Type": "application/json"})
    check_openai(reply.status_code, reply.headers.get("content-type", ""), reply.text)


TOKENIZE = st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(TEXT, JUNK)}, optional={
        "add_special_tokens": st.one_of(st.booleans(), JUNK), "return_token_strs": st.one_of(st.booleans(), JUNK)}),
    st.fixed_dictionaries({"messages": st.one_of(st.lists(MESSAGE, max_size=3), JUNK)}, optional={
        "tools": st.one_of(st.lists(TOOL, max_size=2), JUNK), "add_generation_prompt": st.one_of(st.booleans(), JUNK),
        "continue_final_message": st.one_of(st.booleans(), JUNK), "add_special_tokens": st.one_of(st.booleans(), JUNK),
        "chat_template_kwargs": TEMPLATE_KWARGS}),
    JUNK,
).map(lambda body: body if not isinstance(body, dict) else {**body, "model": "SmolLM2-135M-Instruct"})
DETOKENIZE = st.fixed_dictionaries({"tokens": st.one_of(st.lists(st.integers(-5, 60000), max_size=20),
                                                        st.lists(st.integers(-2**70, 2**70), max_size=3), JUNK)},
                                   optional={"model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=8), JUNK)})


@FUZZ
@given(path=st.sampled_from(["tokenize", "detokenize"]), data=st.data())
def test_tokenize_and_detokenize_answer_every_body_with_their_reply_or_an_openai_error(openai_frontend, llm_stubs, path, data):
    body = data.draw(TOKENIZE if path == "tokenize" else DETOKENIZE)
    reply = requests.post(f"{openai_frontend.url}/{path}", data=json.dumps(body), timeout=120,
                          headers={"Content-Type": "application/json"})
    assert reply.status_code in (200, 400, 404), (reply.status_code, reply.text[:300])
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) > 8, error
    elif path == "tokenize":
        assert reply.json()["count"] == len(reply.json()["tokens"])
    else:
        assert isinstance(reply.json()["prompt"], str)


BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", "t2"]), "name": st.sampled_from(["f", "g"]),
                           "input": st.one_of(st.just({"a": 1}), JUNK)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["t1", "t9"]),
                           "content": st.one_of(TEXT, JUNK)}, optional={"is_error": st.one_of(st.booleans(), JUNK)}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.one_of(TEXT, JUNK)}, optional={"signature": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking"]), "source": JUNK}),
    JUNK,
)
ANTHROPIC_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(TEXT, st.lists(BLOCK, max_size=3))}),
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["system", "tool", "robot"]), JUNK), "content": st.one_of(TEXT, JUNK)}),
    JUNK,
)
MESSAGES = st.fixed_dictionaries(
    {"model": st.just("SmolLM2-135M-Instruct"), "max_tokens": MAX_TOKENS,
     "messages": st.one_of(st.lists(ANTHROPIC_MESSAGE, max_size=4), JUNK)},
    optional={
        "system": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2), JUNK),
        "stop_sequences": st.one_of(st.lists(st.text(max_size=6), max_size=12), JUNK), "stream": st.one_of(st.booleans(), JUNK),
        "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER,
        "tools": st.one_of(st.lists(st.one_of(st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "x y"]), "input_schema": st.one_of(
                st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}), JUNK)}),
            st.fixed_dictionaries({"type": st.just("web_search_20250305"), "name": st.just("web_search")}), JUNK), max_size=2), JUNK),
        "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool", "x"])},
                                                       optional={"name": st.sampled_from(["f", "h"])}), JUNK),
        "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                                    optional={"budget_tokens": st.one_of(st.integers(-2, 600), JUNK)}), JUNK),
        "metadata": st.one_of(st.fixed_dictionaries({"user_id": st.text(max_size=8)}), JUNK), "unknown_field": JUNK,
    },
)


@FUZZ
@given(body=MESSAGES, path=st.sampled_from(["messages", "messages/count_tokens"]))
def test_the_messages_api_answers_every_body_with_a_message_or_an_anthropic_error(openai_frontend, llm_stubs, body, path):
    reply = requests.post(f"{openai_frontend.url}/v1/{path}", data=json.dumps(body), timeout=120,
                          headers={"Content-Type": "application/json"})
    assert reply.status_code in (200, 400, 404), (reply.status_code, reply.text[:300])
    if reply.status_code != 200:
        data = reply.json()
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"} and len(data["error"]["message"]) > 8, data
    elif reply.headers["content-type"].startswith("text/event-stream"):
        events = [line.split(": ", 1)[1] for line in reply.text.splitlines() if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-1] in ("message_stop", "error"), events
    elif path == "messages":
        assert reply.json()["type"] == "message" and reply.json()["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    else:
        assert reply.json()["input_tokens"] > 0


RESPONSE_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": st.one_of(
        TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                              "text": TEXT}), max_size=2), JUNK)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.sampled_from(["c1", "c2"]), "name": st.sampled_from(["f", "g"]),
                           "arguments": st.one_of(st.just('{"a": 1}'), TEXT)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.sampled_from(["c1", "c9"]), "output": st.one_of(TEXT, JUNK)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "x"])}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.one_of(st.just([]), JUNK)}, optional={
        "content": st.one_of(st.just([{"type": "reasoning_text", "text": "hmm"}]), JUNK), "id": st.one_of(TEXT, JUNK)}),
    JUNK,
)
RESPONSES = st.fixed_dictionaries(
    {"model": st.just("SmolLM2-135M-Instruct"), "input": st.one_of(TEXT, st.lists(RESPONSE_ITEM, max_size=4), JUNK),
     "max_output_tokens": MAX_TOKENS},
    optional={
        "instructions": st.one_of(TEXT, JUNK), "temperature": NUMBER, "top_p": NUMBER, "seed": NUMBER,
        "stream": st.one_of(st.booleans(), JUNK), "store": st.one_of(st.booleans(), JUNK),
        "previous_response_id": st.one_of(st.just("resp_missing"), JUNK),
        "tools": st.one_of(st.lists(st.one_of(st.fixed_dictionaries(
            {"type": st.just("function"), "name": st.sampled_from(["f", "g", "x y"]), "parameters": st.one_of(
                st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}), JUNK)}),
            st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search"])}), JUNK), max_size=2), JUNK),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                                 st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "h"])}), JUNK),
        "parallel_tool_calls": st.one_of(st.booleans(), JUNK),
        "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}),
                          st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("x"), "schema": st.one_of(
                              st.just({"type": "object", "properties": {"a": {"type": "integer"}}}), JUNK)}), JUNK)}), JUNK),
        "background": st.one_of(st.booleans(), JUNK), "include": st.one_of(st.lists(st.text(max_size=8), max_size=2), JUNK),
        "reasoning": st.one_of(st.fixed_dictionaries({"effort": st.sampled_from(["low", "high"])}), JUNK),
        "metadata": st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), JUNK), "unknown_field": JUNK,
    },
)


@FUZZ
@given(body=RESPONSES)
def test_the_responses_api_answers_every_body_with_a_response_or_an_openai_error(openai_frontend, llm_stubs, body):
    reply = requests.post(f"{openai_frontend.url}/v1/responses", data=json.dumps(body), timeout=120,
                          headers={"Content-Type": "application/json"})
    assert reply.status_code in (200, 400, 404), (reply.status_code, reply.text[:300])
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) > 8, error
    elif reply.headers["content-type"].startswith("text/event-stream"):
        events = [line.split(": ", 1)[1] for line in reply.text.splitlines() if line.startswith("event: ")]
        assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete", "error"), events
    else:
        assert reply.json()["object"] == "response" and reply.json()["status"] in ("completed", "incomplete")
