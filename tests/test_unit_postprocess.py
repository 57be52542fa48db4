"""``postprocess`` and the stop strings: ids into whole characters, streamed or not, stops cut where
they complete, and a tokenizer that does not match refused; in-process."""

from __future__ import annotations


import pytest
from transformers import AutoTokenizer

from contract.errors import InvalidInput
from contract.stops import TextTracker, find_stop
from contract.tokenizer import decode_text, vocab_fingerprint
from postprocess import Delta, Detokenizer, LLMResponse, PostprocessConfig


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
