"""Reasoning kept apart (contract/reasoning.py): where preprocess says a reply begins, and how a reply is
split, whole and streamed, with the default tokenizer and a thinking template (tests/templates/think.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client import Chunk, reasoned
from conftest import with_template
from contract import reasoning
from contract.errors import InvalidInput
from contract.reasoning import INSIDE, NONE, OUTSIDE, Splitter, split
from preprocess import PreprocessConfig, Preprocessor, PromptRequest

THINK_TEMPLATE = Path(__file__).parent / "templates" / "think.jinja"
REPLIES = [  # (reply text as the model writes it, state, reasoning, answer)
    ("I should greet.\n</think>\n\nHello!", INSIDE, "I should greet.", "Hello!"),
    ("a < b and </thin is not the end</think>Yes", INSIDE, "a < b and </thin is not the end", "Yes"),
    ("still thinking when max_tokens ran out", INSIDE, "still thinking when max_tokens ran out", ""),
    ("\n<think>\nPlan.\n</think>\n\nDone.", OUTSIDE, "Plan.", "Done."),
    ("No thinking, <think> later is text", OUTSIDE, "", "No thinking, <think> later is text"),
    ("<thin", OUTSIDE, "", "<thin"),
    ("Plain </think> text", NONE, "", "Plain </think> text"),
]


@pytest.mark.parametrize("text, state, thinking, answer", REPLIES)
def test_a_finished_reply_splits_into_its_reasoning_and_its_answer(text, state, thinking, answer):
    whole = split(text, state, finished=True)
    assert (whole.reasoning, whole.content) == (thinking, answer)
    assert reasoning.CLOSE not in whole.content or state == NONE


@pytest.mark.parametrize("text, state, thinking, answer", REPLIES)
def test_a_streamed_reply_shows_only_what_it_never_takes_back(text, state, thinking, answer):
    """Every prefix's split extends the one before, so the pieces add up to the whole reply's split."""
    shown = split("", state, finished=False)
    splitter, joined = Splitter(), ["", ""]
    for end in range(1, len(text) + 1):
        now = split(text[:end], state, finished=end == len(text))
        assert now.reasoning.startswith(shown.reasoning) and now.content.startswith(shown.content), text[:end]
        shown = now
        added = splitter.feed(text[end - 1], state, finished=end == len(text))
        joined = [joined[0] + added[0], joined[1] + added[1]]
    assert joined == [thinking, answer]


def test_a_marker_in_the_making_is_held_back():
    assert split("Hmm </thi", INSIDE, finished=False).reasoning == "Hmm"
    assert split("  <thi", OUTSIDE, finished=False) == reasoning.Split("", "")
    assert split("Hmm </thi", INSIDE, finished=True).reasoning == "Hmm </thi"


def test_where_a_reply_begins_follows_the_rendered_prompt():
    assert reasoning.state_of("<|im_start|>assistant\n<think>\n", True) == INSIDE
    assert reasoning.state_of("<|im_start|>assistant\n<think>\n\n</think>\n\n", True) == OUTSIDE
    assert reasoning.state_of("<|im_start|>assistant\n", True) == OUTSIDE
    assert reasoning.state_of("<|im_start|>assistant\n<think>\n", False) == NONE


# the client's chunks: a token's text at a time, as the pipeline streams them


@pytest.mark.parametrize("text, state, thinking, answer", REPLIES)
def test_chunks_streamed_a_token_at_a_time_split_as_the_whole_reply(tokenizer, text, state, thinking, answer):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:end])[len(tokenizer.decode(ids[:end - 1])):] for end in range(1, len(ids) + 1)]
    assert "".join(pieces) == text
    whole = reasoned(Chunk(text, len(ids), 3, "stop", reasoning_state=state), Splitter())
    assert (whole.reasoning_output, whole.text_output) == (thinking, answer)
    splitter = Splitter()
    chunks = [reasoned(Chunk(piece, n + 1, 3, "stop" if n == len(pieces) - 1 else "", reasoning_state=state), splitter)
              for n, piece in enumerate(pieces)]
    assert "".join(c.reasoning_output for c in chunks) == thinking and "".join(c.text_output for c in chunks) == answer
    assert [c.completion_tokens for c in chunks] == list(range(1, len(ids) + 1))  # the rest of each chunk as it came


# preprocess: the thinking template, and chat_template_kwargs


@pytest.fixture(scope="module")
def thinking(model_dir, tmp_path_factory) -> Preprocessor:
    return Preprocessor(PreprocessConfig(str(with_template(model_dir, tmp_path_factory.mktemp("think"), THINK_TEMPLATE))))


@pytest.fixture(scope="module")
def plain(model_dir) -> Preprocessor:
    return Preprocessor(PreprocessConfig(str(model_dir)))


def kwargs(value: object) -> bytes:
    return json.dumps(value).encode()


def test_a_thinking_template_opens_the_reply_inside_thinking_unless_told_otherwise(thinking):
    assert thinking.thinks
    on = thinking.encode(PromptRequest(b"Hi"))
    off = thinking.encode(PromptRequest(b"Hi", chat_template_kwargs=kwargs({"enable_thinking": False})))
    assert on.reasoning_state == INSIDE and off.reasoning_state == OUTSIDE
    assert thinking.tokenizer.decode(on.input_ids).endswith("assistant\n<think>\n")
    assert thinking.tokenizer.decode(off.input_ids).endswith("<think>\n\n</think>\n\n")


def test_a_template_without_thinking_is_not_split_and_ignores_unknown_variables(plain):
    assert not plain.thinks
    default = plain.encode(PromptRequest(b"Hi"))
    assert default.reasoning_state == NONE
    assert plain.encode(PromptRequest(b"Hi", chat_template_kwargs=kwargs({"enable_thinking": False}))) == default
    assert plain.encode(PromptRequest(b"Hi", apply_chat_template=False)).reasoning_state == NONE


def test_the_ids_are_what_apply_chat_template_tokenizes(thinking, plain):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>x</think>\n\nHello"},
                {"role": "user", "content": "Again"}]
    ids = {}
    for name, preprocessor in (("thinking", thinking), ("plain", plain)):
        ids[name] = preprocessor.encode(PromptRequest(messages=json.dumps(messages).encode())).input_ids
        assert ids[name] == list(preprocessor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert "<think>x" not in thinking.tokenizer.decode(ids["thinking"])  # the template dropped the earlier thinking


def test_a_reply_held_to_a_grammar_starts_after_the_thinking(thinking):
    """A grammar holds the reply from its first token: the open block is closed in the prompt for it."""
    held = thinking.encode(PromptRequest(b"Hi", structured_outputs=kwargs({"json_object": True})))
    assert held.reasoning_state == OUTSIDE
    assert thinking.tokenizer.decode(held.input_ids).endswith("assistant\n<think>\n</think>\n\n")


@pytest.mark.parametrize("raw, message", [
    (b"[1]", "chat_template_kwargs must be a JSON object"),
    (b"{", "chat_template_kwargs is not valid JSON"),
    (kwargs({"add_generation_prompt": False, "tools": []}), r"may not set \['add_generation_prompt', 'tools'\]"),
    (kwargs({"messages": []}), r"may not set \['messages'\]"),
    (kwargs({"enable_thinking": "yes"}), "chat_template_kwargs and messages: the chat template refused them: "
                                         "enable_thinking must be true or false"),
])
def test_bad_chat_template_kwargs_name_the_field(thinking, raw, message):
    with pytest.raises(InvalidInput, match=message):
        thinking.encode(PromptRequest(b"Hi", chat_template_kwargs=raw))


def test_chat_template_kwargs_need_the_chat_template(thinking):
    with pytest.raises(InvalidInput, match="chat_template_kwargs needs apply_chat_template=true"):
        thinking.encode(PromptRequest(b"Hi", apply_chat_template=False, chat_template_kwargs=kwargs({})))
