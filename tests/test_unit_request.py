"""llm's request validation without a model: every range from contract/schema.py, every limit from Limits."""

from __future__ import annotations

import pytest

from contract.errors import InvalidInput
from llm.request import GenerationRequest, Limits, SamplingParams, validate

LIMITS = Limits(vocab_size=100, room=64, default_max_tokens=8, max_tokens_limit=16, max_stop_count=2,
                max_stop_bytes=4, fingerprint="v1")


def test_validation_needs_only_the_limits_not_a_model():
    assert validate(LIMITS, [1, 2]) == GenerationRequest([1, 2], 8)


def test_each_sampling_field_reaches_sampling_params_by_its_name():
    request = validate(LIMITS, [1], 4, temperature=0.5, top_p=0.9, top_k=3, min_p=0.2, repetition_penalty=1.1,
                       presence_penalty=0.3, frequency_penalty=-0.3, seed=9, logit_bias=b'{"7": -100, "3": 2.5}',
                       min_tokens=2, stop_token_ids=[4, 5])
    assert request.sampling == SamplingParams(0.5, 0.9, 3, 0.2, 1.1, 0.3, -0.3, 9, ((3, 2.5), (7, -100.0)), 2, (4, 5))


@pytest.mark.parametrize("fields, message", [
    ({"min_p": -0.1}, r"min_p must be in \[0.0, 1.0\], got -0.1"),
    ({"min_p": float("nan")}, "min_p must be a finite number"),
    ({"min_tokens": 17}, r"min_tokens must be in \[0, 16\], got 17"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens=5 must not exceed max_tokens=4"),
    ({"stop_token_ids": [100]}, r"stop_token_ids\[0\] must be in \[0, 99\], got 100"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids holds 65 entries; the limit is 64"),
    ({"logit_bias": b"{"}, "logit_bias is not valid JSON"),
    ({"logit_bias": b"[1]"}, "logit_bias must be a JSON object"),
    ({"logit_bias": b'{"x": 1}'}, "logit_bias key 'x' is not a token id"),
    ({"logit_bias": b'{"100": 1}'}, r"logit_bias key '100' is outside the model vocabulary \[0, 100\)"),
    ({"logit_bias": b'{"1": -101}'}, r"logit_bias\['1'\] must be in \[-100.0, 100.0\], got -101"),
    ({"logit_bias": b'{"1": "a"}'}, r"logit_bias\['1'\] must be a number, got 'a'"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias holds 301 entries; the limit is 300"),
    ({"logit_bias": b"\xff"}, "logit_bias is not valid UTF-8"),
    ({"stop": [b"toolong"]}, r"stop\[0\] is 7 bytes; the limit is 4 \(max_stop_bytes\)"),
    ({"tokenizer_fingerprint": "v2"}, "does not match the llm model's vocabulary"),
])
def test_bad_values_name_the_field_and_the_limit(fields, message):
    with pytest.raises(InvalidInput, match=message):
        validate(LIMITS, [1], **fields)


def test_an_unknown_field_is_a_programming_error_not_a_client_one():
    with pytest.raises(TypeError, match="unknown request fields"):
        validate(LIMITS, [1], temprature=0.5)
