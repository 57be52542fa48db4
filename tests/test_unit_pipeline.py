"""Unit tests of the preprocess / llm / postprocess logic, in-process, without a server."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from contract.errors import InvalidInput
from contract.stops import TextTracker, find_stop
from contract.tokenizer import decode_text, vocab_fingerprint
from postprocess import LLMResponse, Delta, Detokenizer, PostprocessConfig
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from triton_glue.params import read_parameters


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
    ids = preprocessor.encode(PromptRequest("Hello".encode())).input_ids
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert "Hello" in tokenizer.decode(ids)


def test_system_prompt_replaces_the_template_default(preprocessor, tokenizer):
    default = tokenizer.decode(preprocessor.encode(PromptRequest(b"Hi")).input_ids)
    custom = tokenizer.decode(preprocessor.encode(PromptRequest(b"Hi", "You are a pirate.".encode())).input_ids)
    assert "You are a pirate." in custom and "You are a pirate." not in default


def test_raw_prompt_skips_the_template(preprocessor, tokenizer):
    ids = preprocessor.encode(PromptRequest(b"Once upon a time", apply_chat_template=False)).input_ids
    assert ids == tokenizer.encode("Once upon a time")


def test_messages_carry_a_whole_conversation_through_the_chat_template(preprocessor, tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
    ids = preprocessor.encode(PromptRequest(messages=json.dumps(conversation).encode())).input_ids
    assert ids == list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True))


@pytest.mark.parametrize(
    "request_, message",
    [
        (PromptRequest(b""), "text_input must not be empty"),
        (PromptRequest(b"   "), "text_input must not be empty"),
        (PromptRequest(b"ab\xffcd"), "text_input is not valid UTF-8: byte 0xff at offset 2"),
        (PromptRequest(b"x" * 1001), "text_input is 1001 bytes; the limit is 1000 bytes"),
        (PromptRequest(b"hi", b"\xc3"), "system_prompt is not valid UTF-8"),
        (PromptRequest(b"hi", b"sys", apply_chat_template=False), "system_prompt needs apply_chat_template=true"),
        (PromptRequest(), "text_input is required"),
        (PromptRequest(b"hi", messages=b'[{"role": "user", "content": "x"}]'), "either messages or text_input"),
        (PromptRequest(messages=b"[{"), "messages is not valid JSON"),
        (PromptRequest(messages=b"{}"), "messages must be a non-empty JSON list"),
        (PromptRequest(messages=b'[{"role": "user"}]'), r"messages\[0\] must be an object with exactly the keys role and content"),
        (PromptRequest(messages=b'[{"role": "bot", "content": "x"}]'), r"messages\[0\].role must be one of system, user, assistant, tool"),
        (PromptRequest(messages=b'[{"role": "user", "content": 5}]'), r"messages\[0\].content must be a string"),
        (PromptRequest(messages=b'[{"role": "user", "content": "x"}]', apply_chat_template=False), "messages needs apply_chat_template=true"),
        (PromptRequest(messages=b"[" + b"1," * 600 + b"1]"), "messages is 1203 bytes; the limit is 1000 bytes"),
    ],
)
def test_bad_prompts_name_the_field(preprocessor, request_, message):
    with pytest.raises(InvalidInput, match=message):
        preprocessor.encode(request_)


def test_a_system_message_alone_is_a_conversation(preprocessor):
    """OpenAI answers one, and so does the chat template: the system turn, then the assistant's."""
    alone = preprocessor.encode(PromptRequest(messages=b'[{"role": "system", "content": "Be brief."}]')).input_ids
    rendered = preprocessor.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}],
                                                          add_generation_prompt=True, tokenize=True)
    assert alone == list(rendered) and len(alone) > 3


# postprocess

TEXT = "天空是蓝色的 🌍😀 ok"


@pytest.fixture(scope="module")
def detokenizer(model_dir) -> Detokenizer:
    return Detokenizer(PostprocessConfig(str(model_dir)))


def whole(detokenizer: Detokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> str:
    return detokenizer.delta(LLMResponse(ids, 0, finished=True, stop=stop)).text


def deltas(detokenizer: Detokenizer, ids: list[int], stop: tuple[str, ...] = (), every: int = 1,
           starts: list[int] | None = None, logprobs: bool = False, min_tokens: int = 0) -> list[Delta]:
    """A stream's responses as llm sends them: one every ``every`` tokens and at the end (the last id, or
    the one that completes a stop string), each carrying only the tail of the ids that
    ``TextTracker.window`` says postprocess needs. With ``logprobs``, each id's logprob is its position."""
    tracker = TextTracker(lambda some: decode_text(detokenizer.tokenizer, some), stop, min_tokens)
    rows = [[-float(i), -1.0] for i in range(len(ids))]
    found, sent = [], 0
    for n in range(1, len(ids) + 1):
        finished = tracker.add(ids[:n]) or n == len(ids)
        if n % every and not finished:
            continue
        start = tracker.window(sent)
        if starts is not None:
            starts.append(start)
        found.append(detokenizer.delta(LLMResponse(
            ids[start:n], sent - start, finished=finished, stop=stop, stop_after=tracker.stop_after(start),
            logprobs=rows[start:n] if logprobs else None, top_ids=[[0]] * (n - start) if logprobs else None,
        )))
        sent = n
        if finished:
            return found
    return found


def stream(detokenizer: Detokenizer, ids: list[int], stop: tuple[str, ...] = (), every: int = 1,
           starts: list[int] | None = None) -> list[str]:
    """The text chunks of ``deltas``."""
    return [d.text for d in deltas(detokenizer, ids, stop, every, starts)]


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


def test_the_last_response_names_the_stop_string_that_ended_the_reply(detokenizer, tokenizer):
    """The shortest of those that start where the text is cut: the one generation completed first."""
    ids = tokenizer.encode(TEXT)
    assert detokenizer.delta(LLMResponse(ids, 0, finished=True, stop=("never", "🌍😀", "🌍"))).stop_reason == "🌍"
    assert detokenizer.delta(LLMResponse(ids, 0, finished=True, stop=("never",))).stop_reason == ""
    assert detokenizer.delta(LLMResponse(ids, 0, finished=False, stop=("🌍",))).stop_reason == ""


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


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("stop", [(), ("行 line 5",)])
def test_each_tokens_logprobs_arrive_once_with_the_chunk_that_shows_its_text(detokenizer, tokenizer, every, stop):
    ids = tokenizer.encode(LONG)
    found = deltas(detokenizer, ids, stop, every, logprobs=True)
    positions = [-int(entry["logprob"]) for d in found for entry in d.logprobs]
    assert positions == list(range(len(positions)))  # each token once, in order ...
    assert positions[-1] == len(ids) - 1 if not stop else positions[-1] < len(ids)  # ... up to the last generated
    text, count = "", 0
    for d in found[:-1]:  # every token so far has all its text in the chunks so far
        text, count = text + d.text, count + len(d.logprobs)
        assert text.startswith(decode_text(tokenizer, ids[:count]))
    entry = next(e for d in found for e in d.logprobs)
    assert entry["token"] == tokenizer.decode([ids[0]]) and entry["bytes"] == list(entry["token"].encode())
    assert entry["top_logprobs"] == [{"token": tokenizer.decode([0]), "bytes": list(tokenizer.decode([0]).encode()), "logprob": -1.0}]


def test_the_text_tracker_finds_a_stop_string_at_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode(LONG)
    stop = ("行 line 4",)
    tracker = TextTracker(lambda some: decode_text(tokenizer, some), stop)
    found = next(n for n in range(1, len(ids) + 1) if tracker.add(ids[:n]))
    assert find_stop(decode_text(tokenizer, ids[:found]), stop) is not None
    assert find_stop(decode_text(tokenizer, ids[: found - 1]), stop) is None


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("min_tokens", [0, 1, 40, 150])
def test_with_min_tokens_a_stop_string_counts_only_when_it_ends_after_them(detokenizer, tokenizer, every, min_tokens):
    """As vLLM: llm stops at, and postprocess cuts before, the first stop string that ends after the text
    of the first min_tokens ids; earlier ones stay in the reply. Streamed in windows or whole, the same."""
    ids, stop = tokenizer.encode(LONG), ("line",)
    text = decode_text(tokenizer, ids)
    cut = find_stop(text, stop, after=len(decode_text(tokenizer, ids[:min_tokens])))
    assert text.count("line") > 5 and (cut == text.index("line")) == (min_tokens < 5)
    found = deltas(detokenizer, ids, stop, every, min_tokens=min_tokens)
    assert "".join(d.text for d in found) == text[:cut]
    tracker = TextTracker(lambda some: decode_text(tokenizer, some), stop, min_tokens)
    stopped = next(n for n in range(1, len(ids) + 1) if tracker.add(ids[:n]))
    assert find_stop(decode_text(tokenizer, ids[:stopped]), stop, after=len(decode_text(tokenizer, ids[:min_tokens]))) == cut
    assert stopped > min_tokens


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




def test_a_relative_folder_is_refused_naming_the_parameter():
    from contract.paths import allowed_folder

    with pytest.raises(ValueError, match="parameter 'tokenizer_dir': models/x is a relative path"):
        allowed_folder("tokenizer_dir", "models/x")


def test_the_admin_client_drops_the_python_stack_from_a_failed_load():
    from client.admin import reason

    message = ("load failed for model 'preprocess': version 1 is at UNAVAILABLE state: Internal: ValueError: "
               "parameter 'tokenizer_dir': /etc is outside MODEL_ROOTS (/m)\n\nAt:\n  /r/contract/paths.py(23): "
               "allowed_folder\n  /r/preprocess/__init__.py(42): __init__\n;\n")
    assert reason(message).endswith("parameter 'tokenizer_dir': /etc is outside MODEL_ROOTS (/m)")


def test_the_admin_client_refuses_a_relative_tokenizer_dir_before_asking_the_server():
    from client.admin import swap_tokenizer

    with pytest.raises(RuntimeError, match="absolute path"):
        swap_tokenizer("127.0.0.1:1", "models/x")


def test_parameters_take_environment_defaults_nested_and_name_the_key_when_unset(monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class Config:
        tokenizer_dir: str
        kv_cache_tokens: int = 0

    def config(tokenizer_dir: str, kv: str) -> dict:
        return {"name": "m", "parameters": {"tokenizer_dir": {"string_value": tokenizer_dir}, "kv_cache_tokens": {"string_value": kv}}}

    monkeypatch.setenv("MODEL_DIR", "/models/a")
    monkeypatch.delenv("TOKENIZER_DIR", raising=False)
    monkeypatch.delenv("KV_CACHE_TOKENS", raising=False)
    assert read_parameters(config("${TOKENIZER_DIR:-${MODEL_DIR}}", "${KV_CACHE_TOKENS:-16384}"), Config) == Config("/models/a", 16384)
    monkeypatch.setenv("TOKENIZER_DIR", "/models/b")
    monkeypatch.setenv("KV_CACHE_TOKENS", "32768")
    assert read_parameters(config("${TOKENIZER_DIR:-${MODEL_DIR}}", "${KV_CACHE_TOKENS:-16384}"), Config) == Config("/models/b", 32768)
    with pytest.raises(ValueError, match=r"parameter 'tokenizer_dir' references \$\{UNSET_DIR\}"):
        read_parameters(config("${UNSET_DIR}", "1"), Config)
