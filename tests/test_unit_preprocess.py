"""``preprocess``: prompts and conversations through the chat template into ids, in-process."""

from __future__ import annotations

import json

import pytest

from contract.errors import InvalidInput
from preprocess import PreprocessConfig, Preprocessor, PromptRequest


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
