"""Unit tests of the preprocess / llm / postprocess logic, in-process, without a server."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from postprocess import Chunk, Detokenizer, PostprocessConfig
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


def whole(detokenizer: Detokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> str:
    return detokenizer.text(Chunk(ids, 0, finished=True, stop=stop))


def stream(detokenizer: Detokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> list[str]:
    """One chunk per token, as postprocess sees a stream; the last one finishes."""
    return [detokenizer.text(Chunk(ids[:n], n - 1, finished=n == len(ids), stop=stop)) for n in range(1, len(ids) + 1)]


def test_detokenizer_round_trips_chinese_and_emoji(detokenizer, tokenizer):
    assert whole(detokenizer, tokenizer.encode(TEXT)) == TEXT


def test_cut_replies_are_complete_utf8_prefixes(detokenizer, tokenizer):
    ids = tokenizer.encode(TEXT)
    for end in range(len(ids) + 1):
        text = whole(detokenizer, ids[:end])
        assert "\ufffd" not in text and TEXT.startswith(text), (end, text)


def test_streamed_chunks_are_whole_characters_that_add_up(detokenizer, tokenizer):
    chunks = stream(detokenizer, tokenizer.encode(TEXT))
    assert all("\ufffd" not in c for c in chunks) and "".join(chunks) == TEXT
    assert "" in chunks  # a token that ends inside a character waits for the next one


@pytest.mark.parametrize("stop", [("蓝色",), ("🌍",), (" o", "天空是蓝x")])
def test_a_stop_string_cuts_the_text_and_never_leaks_into_a_chunk(detokenizer, tokenizer, stop):
    ids = tokenizer.encode(TEXT)
    expected = TEXT[: min(TEXT.index(s) for s in stop if s in TEXT)]
    chunks = stream(detokenizer, ids, stop)
    assert "".join(chunks) == expected == whole(detokenizer, ids, stop)


def test_a_partial_stop_string_is_released_at_the_end(detokenizer, tokenizer):
    ids = tokenizer.encode(TEXT)
    assert "".join(stream(detokenizer, ids, ("ok!",))) == TEXT


def test_special_tokens_are_left_out(detokenizer, tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert whole(detokenizer, ids) == "assistant\nHi"


def test_fingerprint_mismatch_is_refused(detokenizer):
    with pytest.raises(InvalidInput, match="does not match postprocess's tokenizer"):
        detokenizer.check("0000000000000000")


def test_ids_beyond_the_tokenizer_are_refused(detokenizer):
    with pytest.raises(InvalidInput, match="outside the tokenizer vocabulary"):
        whole(detokenizer, [10**6])


def test_fingerprint_ignores_the_chat_template_but_not_the_vocabulary(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    before = vocab_fingerprint(tokenizer)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert vocab_fingerprint(tokenizer) == before
    tokenizer.add_tokens(["<brand_new_token>"])
    assert vocab_fingerprint(tokenizer) != before


