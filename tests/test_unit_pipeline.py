"""Unit tests of the preprocess / llm / postprocess logic, in-process, without a server."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from llm import Generator, LLMConfig
from postprocess import Detokenizer, PostprocessConfig
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from serving.errors import InvalidInput
from serving.params import read_parameters
from serving.tokenizer import vocab_fingerprint


def params(**values: str) -> dict:
    return {"name": "m", "parameters": {k: {"string_value": v} for k, v in values.items()}}


@dataclass(frozen=True)
class Sample:
    path: str
    count: int = 3
    flag: bool = False


def test_parameters_expand_environment_variables(monkeypatch):
    monkeypatch.setenv("SOME_DIR", "/models/x")
    assert read_parameters(params(path="${SOME_DIR}/tok", count="7", flag="true"), Sample) == Sample("/models/x/tok", 7, True)


def test_parameters_name_the_unset_variable(monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match=r"'path' references \$\{NOT_SET_ANYWHERE\}"):
        read_parameters(params(path="${NOT_SET_ANYWHERE}"), Sample)


def test_parameters_name_the_bad_key():
    with pytest.raises(ValueError, match="'count' must be int"):
        read_parameters(params(path="p", count="many"), Sample)


def test_parameters_report_a_missing_required_key():
    with pytest.raises(ValueError, match="missing a required parameter"):
        read_parameters(params(count="1"), Sample)


# preprocess


@pytest.fixture(scope="module")
def preprocessor(model_dir) -> Preprocessor:
    return Preprocessor(PreprocessConfig(str(model_dir), max_input_bytes=1000))


def test_chat_template_ends_with_the_assistant_turn(preprocessor, tokenizer):
    ids = preprocessor.encode(PromptRequest("Hello".encode()))
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert "Hello" in tokenizer.decode(ids)


def test_system_prompt_replaces_the_template_default(preprocessor, tokenizer):
    default = tokenizer.decode(preprocessor.encode(PromptRequest(b"Hi")))
    custom = tokenizer.decode(preprocessor.encode(PromptRequest(b"Hi", "You are a pirate.".encode())))
    assert "You are a pirate." in custom and "You are a pirate." not in default


def test_raw_prompt_skips_the_template(preprocessor, tokenizer):
    ids = preprocessor.encode(PromptRequest(b"Once upon a time", apply_chat_template=False))
    assert ids == tokenizer.encode("Once upon a time")


@pytest.mark.parametrize(
    "request_, message",
    [
        (PromptRequest(b""), "text_input must not be empty"),
        (PromptRequest(b"   "), "text_input must not be empty"),
        (PromptRequest(b"ab\xffcd"), "text_input is not valid UTF-8: byte 0xff at offset 2"),
        (PromptRequest(b"x" * 1001), "text_input is 1001 bytes; the limit is 1000 bytes"),
        (PromptRequest(b"hi", b"\xc3"), "system_prompt is not valid UTF-8"),
        (PromptRequest(b"hi", b"sys", apply_chat_template=False), "system_prompt needs apply_chat_template=true"),
    ],
)
def test_bad_prompts_name_the_field(preprocessor, request_, message):
    with pytest.raises(InvalidInput, match=message):
        preprocessor.encode(request_)


# postprocess

TEXT = "天空是蓝色的 🌍😀 ok"


@pytest.fixture(scope="module")
def detokenizer(model_dir) -> Detokenizer:
    return Detokenizer(PostprocessConfig(str(model_dir)))


def test_detokenizer_round_trips_chinese_and_emoji(detokenizer, tokenizer):
    assert detokenizer.decode(tokenizer.encode(TEXT), detokenizer.fingerprint) == TEXT


def test_cut_replies_are_complete_utf8_prefixes(detokenizer, tokenizer):
    ids = tokenizer.encode(TEXT)
    for end in range(len(ids) + 1):
        text = detokenizer.decode(ids[:end], detokenizer.fingerprint)
        assert "\ufffd" not in text and TEXT.startswith(text), (end, text)


def test_special_tokens_are_left_out(detokenizer, tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert detokenizer.decode(ids, detokenizer.fingerprint) == "assistant\nHi"


def test_fingerprint_mismatch_is_refused(detokenizer):
    with pytest.raises(InvalidInput, match="does not match postprocess's tokenizer"):
        detokenizer.decode([1, 2], "0000000000000000")


def test_ids_beyond_the_tokenizer_are_refused(detokenizer):
    with pytest.raises(InvalidInput, match="outside the tokenizer vocabulary"):
        detokenizer.decode([10**6], detokenizer.fingerprint)


def test_fingerprint_ignores_the_chat_template_but_not_the_vocabulary(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    before = vocab_fingerprint(tokenizer)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert vocab_fingerprint(tokenizer) == before
    tokenizer.add_tokens(["<brand_new_token>"])
    assert vocab_fingerprint(tokenizer) != before


# llm, with a tiny random model


@pytest.fixture(scope="module")
def generator() -> Generator:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return Generator(LLMConfig("unused", default_max_tokens=4, max_tokens_limit=16), torch.device("cpu"), model)


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]


def test_a_batch_of_mixed_lengths_matches_one_by_one(generator):
    requests = [generator.validate(ids, 8) for ids in PROMPTS]
    assert generator.generate(requests) == [generator.generate([r])[0] for r in requests]


def test_each_row_keeps_its_own_max_tokens(generator):
    requests = [generator.validate(ids, n) for ids, n in zip(PROMPTS, [1, 8, 3])]
    assert [len(reply) for reply in generator.generate(requests)] == [1, 8, 3]


def test_default_max_tokens_applies_when_absent(generator):
    assert generator.validate([1, 2], None).max_tokens == 4


def test_greedy_is_deterministic(generator):
    request = generator.validate(PROMPTS[1], 8)
    assert generator.generate([request]) == generator.generate([request])


def test_eos_ends_the_reply_and_is_not_returned(generator):
    request = generator.validate(PROMPTS[0], 8)
    first = generator.generate([request])[0]
    generator.eos_ids = {first[2]}
    try:
        assert generator.generate([request])[0] == first[: first.index(first[2])]
    finally:
        generator.eos_ids = set()


@pytest.mark.parametrize(
    "ids, max_tokens, message",
    [
        ([1], 0, r"max_tokens must be in \[1, 16\], got 0"),
        ([1], -3, r"max_tokens must be in \[1, 16\], got -3"),
        ([1], 17, r"max_tokens must be in \[1, 16\], got 17"),
        ([], 4, "input_ids must not be empty"),
        ([1, 256], 4, r"token id 256, outside the model vocabulary \[0, 256\)"),
        ([1, -1], 4, "token id -1"),
        ([1] * 60, 8, "prompt is 60 tokens; with max_tokens=8 it exceeds the context of 64 tokens"),
    ],
)
def test_invalid_requests_name_the_field_and_limit(generator, ids, max_tokens, message):
    with pytest.raises(InvalidInput, match=message):
        generator.validate(ids, max_tokens)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float8"}, "parameter 'dtype'"),
        ({"default_max_tokens": 600}, "parameter 'default_max_tokens'"),
        ({"max_context_tokens": -1}, "parameter 'max_context_tokens'"),
    ],
)
def test_bad_llm_config_fails_the_load(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig("m", **kwargs)


def test_ignore_eos_generates_exactly_max_tokens(generator):
    request = generator.validate(PROMPTS[0], 8)
    first = generator.generate([request])[0]
    generator.eos_ids = {first[1]}
    try:
        stopped, forced = generator.generate([request, generator.validate(PROMPTS[0], 8, ignore_eos=True)])
        assert forced == first and stopped == first[: first.index(first[1])]
    finally:
        generator.eos_ids = set()
