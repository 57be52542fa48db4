"""Bad input gets a clear 400 naming the field and limit; batch-mates and the server are unaffected."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def infer_json(url: str, inputs: list[dict], model: str = "ensemble_infer") -> requests.Response:
    return requests.post(f"{url}/v2/models/{model}/infer", json={"inputs": inputs}, timeout=300)


def text(value: str) -> dict:
    return {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [value]}


def test_missing_text_input_is_refused(generate):
    reply = generate({"max_tokens": 8})
    assert reply.status_code == 400 and "text_input" in reply.json()["error"]


def test_empty_text_input_is_refused(generate):
    reply = generate({"text_input": "", "max_tokens": 8})
    assert reply.status_code == 400 and "text_input must not be empty" in reply.json()["error"]


def test_invalid_utf8_is_refused_over_http_binary(http_url):
    client = httpclient.InferenceServerClient(http_url.removeprefix("http://"))
    tensor = httpclient.InferInput("text_input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"caf\xe9 \xff"]], dtype=np.object_), binary_data=True)
    with pytest.raises(InferenceServerException, match="text_input is not valid UTF-8: byte 0xe9 at offset 3"):
        client.infer("ensemble_infer", [tensor])


def test_invalid_utf8_is_refused_over_grpc(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    tensor = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"\xc3\x28"]], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="text_input is not valid UTF-8"):
        client.infer("ensemble_infer", [tensor])


@pytest.mark.parametrize("max_tokens", [0, -5, 513, 100000])
def test_max_tokens_out_of_range_is_refused(generate, max_tokens):
    reply = generate({"text_input": "hi", "max_tokens": max_tokens})
    assert reply.status_code == 400
    assert f"max_tokens must be in [1, 512], got {max_tokens}" in reply.json()["error"]


def test_prompt_longer_than_the_context_is_refused(generate):
    reply = generate({"text_input": "hello " * 9000, "max_tokens": 8})
    assert reply.status_code == 400
    assert "with max_tokens=8 it exceeds the 8192 tokens one request may hold" in reply.json()["error"]


def test_prompt_over_the_byte_limit_is_refused(generate):
    reply = generate({"text_input": "x" * 70000, "max_tokens": 8})
    assert reply.status_code == 400 and "the limit is 65536 bytes (max_input_bytes)" in reply.json()["error"]


@pytest.mark.parametrize(
    "inputs, name",
    [
        ([text("hi"), {"name": "max_tokens", "shape": [1, 1], "datatype": "FP32", "data": [8.0]}], "max_tokens"),
        ([{"name": "text_input", "shape": [1, 1], "datatype": "INT32", "data": [7]}], "text_input"),
    ],
)
def test_wrong_datatype_is_refused(http_url, inputs, name):
    reply = infer_json(http_url, inputs)
    assert reply.status_code == 400 and name in reply.json()["error"]


def test_a_client_batch_of_two_is_refused_clearly(http_url):
    reply = infer_json(http_url, [{"name": "text_input", "shape": [2, 1], "datatype": "BYTES", "data": ["a", "b"]}])
    assert reply.status_code == 400 and "batch dimension 2; send one prompt per request" in reply.json()["error"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": -0.5}, "temperature must be in [0.0, 2.0], got -0.5"),
        ({"temperature": 3}, "temperature must be in [0.0, 2.0], got 3.0"),
        ({"top_p": 0}, "top_p must be in (0.0, 1.0], got 0.0"),
        ({"top_k": -1}, "top_k must be in [0, 49152], got -1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0.0, 2.0], got 0.0"),
        ({"seed": -1}, "seed must be in [0, 9223372036854775807], got -1"),
        ({"stop": ["a"] * 9}, "stop holds 9 strings; the limit is 8 (max_stop_count)"),
        ({"stop": ["x" * 129]}, "stop[0] is 129 bytes; the limit is 128 (max_stop_bytes)"),
        ({"stop": ["ok", ""]}, "stop[1] must not be empty"),
        ({"min_p": 1.5}, "min_p must be in [0.0, 1.0], got 1.5"),
        ({"min_tokens": 5}, "min_tokens=5 must not exceed max_tokens=4"),
        ({"logit_bias": "{"}, "logit_bias is not valid JSON"),
        ({"logit_bias": '{"abc": 1}'}, "logit_bias key 'abc' is not a token id"),
        ({"logit_bias": '{"7042": -150}'}, "logit_bias['7042'] must be in [-100.0, 100.0], got -150"),
        ({"stop_token_ids": [49152]}, "stop_token_ids[0] must be in [0, 49151], got 49152"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids holds 65 entries; the limit is 64"),
    ],
)
def test_sampling_and_stop_out_of_range_are_refused(generate, params, message):
    reply = generate({"text_input": "hi", "max_tokens": 4, **params})
    assert reply.status_code == 400 and message in reply.json()["error"]


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_non_finite_temperature_is_refused(http_url, value):
    body = '{"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}, ' \
           '{"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [%s]}]}' % value
    reply = requests.post(f"{http_url}/v2/models/ensemble_infer/infer", data=body, timeout=300)
    assert reply.status_code == 400 and "temperature must be a finite number" in reply.json()["error"]


def test_token_ids_beyond_the_model_vocabulary_are_refused(generate):
    reply = generate({"input_ids": [1, 2, 60000]}, model="llm")
    assert reply.status_code == 400
    assert "token id 60000, outside the model vocabulary [0, 49152)" in reply.json()["error"]


def test_one_bad_request_in_a_batch_fails_alone(generate):
    bodies = [{"text_input": f"Say something about the number {i}.", "max_tokens": 24} for i in range(7)]
    bodies.insert(3, {"text_input": "hello " * 9000, "max_tokens": 24})
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(generate, bodies))
    assert [r.status_code for r in replies] == [200] * 3 + [400] + [200] * 4
    assert all(r.json()["text_output"].strip() for i, r in enumerate(replies) if i != 3)


def test_zz_server_still_answers_after_bad_input(http_url, generate):
    assert requests.get(f"{http_url}/v2/health/ready", timeout=10).status_code == 200
    reply = generate({"text_input": "What is 2 + 2?", "max_tokens": 8})
    assert reply.status_code == 200 and reply.json()["text_output"].strip()
