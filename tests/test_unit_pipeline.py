"""Unit tests of the preprocess / llm / postprocess logic, in-process, without a server."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from postprocess import Chunk, Detokenizer, PostprocessConfig
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from serving.errors import InvalidInput
from serving.params import read_parameters
from serving.stops import TextTracker, find_stop
from serving.tokenizer import decode_text, vocab_fingerprint


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


def stream(detokenizer: Detokenizer, ids: list[int], stop: tuple[str, ...] = (), every: int = 1,
           starts: list[int] | None = None) -> list[str]:
    """The chunks of a stream as llm sends them: a response every ``every`` tokens and at the end (the last
    id, or the one that completes a stop string), each carrying only the tail of the ids that
    ``TextTracker.window`` says postprocess needs."""
    tracker = TextTracker(lambda some: decode_text(detokenizer.tokenizer, some), stop)
    chunks, sent = [], 0
    for n in range(1, len(ids) + 1):
        finished = tracker.add(ids[:n]) or n == len(ids)
        if n % every and not finished:
            continue
        start = tracker.window(sent)
        if starts is not None:
            starts.append(start)
        chunks.append(detokenizer.text(Chunk(ids[start:n], sent - start, finished=finished, stop=stop)))
        sent = n
        if finished:
            return chunks
    return chunks


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


LONG = " ".join(f"{TEXT} 第{i}行 line {i}." for i in range(12))


@pytest.mark.parametrize("every", [1, 3, 7])
@pytest.mark.parametrize("stop", [(), ("行 line 9",), ("🌍😀 ok 第1", "x" * 40), ("never there, but a long stop string",)])
def test_responses_carrying_only_a_window_of_ids_add_up_to_the_whole_reply(detokenizer, tokenizer, every, stop):
    ids = tokenizer.encode(LONG)
    chunks = stream(detokenizer, ids, stop, every)
    assert "".join(chunks) == whole(detokenizer, ids, stop)
    assert all("\ufffd" not in c for c in chunks)


def test_a_response_carries_a_few_ids_not_the_whole_reply(detokenizer, tokenizer):
    """Postprocess decodes only a window per response: linear work over a stream, not quadratic."""
    ids = tokenizer.encode(LONG)
    starts: list[int] = []
    stream(detokenizer, ids, every=1, starts=starts)
    assert len(ids) > 200 and max(n - start for n, start in enumerate(starts, 1)) <= 4


def test_the_text_tracker_finds_a_stop_string_at_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode(LONG)
    stop = ("行 line 4",)
    tracker = TextTracker(lambda some: decode_text(tokenizer, some), stop)
    found = next(n for n in range(1, len(ids) + 1) if tracker.add(ids[:n]))
    assert find_stop(decode_text(tokenizer, ids[:found]), stop) is not None
    assert find_stop(decode_text(tokenizer, ids[: found - 1]), stop) is None


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


