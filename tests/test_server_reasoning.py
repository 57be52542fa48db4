"""Reasoning kept apart on a real tritonserver: preprocess swapped to a thinking model's chat template
(tests/templates/think.jinja, Qwen3's kind), and the thinking read through each API's official client:
``reasoning_content`` in chat completions (whole and streamed), a ``reasoning`` item in the Responses API,
a ``thinking`` block in the Messages API, ``reasoning_output`` from the Triton client (Triton itself says
where the reply began: ``reasoning_state``); ``chat_template_kwargs`` reaching the template. Properties only: whatever the 135M model writes, the reply is the split of what
it wrote (the same prompt sent raw), the thinking is never in the answer, and a stream adds up to the whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import openai
import pytest
import requests

from client import Prompt
from client.admin import swap_tokenizer
from conftest import Colour, Weather, with_template
from contract.reasoning import INSIDE, OUTSIDE, split

THINK_TEMPLATE = Path(__file__).parent / "templates" / "think.jinja"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
BUDGET = 24
OFF = {"enable_thinking": False}
# A grammar that makes the model think, then answer: both parts exist whatever the model prefers.
THOUGHT, ANSWER = r"[a-z]{1,10}( [a-z]{1,10}){2,4}", r"[A-Z][a-z]{1,8}\."
FORCED = {"regex": f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"}


@pytest.fixture(scope="module")
def think(server, grpc_url, model_dir, tmp_path_factory):
    """preprocess with a thinking template (postprocess splits what preprocess says; it needs no swap)."""
    folder = with_template(model_dir, tmp_path_factory.mktemp("think"), THINK_TEMPLATE)
    swap_tokenizer(grpc_url, str(folder), ("preprocess",), server.admin_key)
    yield
    swap_tokenizer(grpc_url, str(model_dir), ("preprocess",), server.admin_key)


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


def test_a_template_without_thinking_has_no_reasoning(openai_client, model, http_client):
    """The default template (first: the module's other tests swap the thinking one in): no reasoning field
    anywhere, the text as it always was."""
    message = openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0).choices[0].message
    assert "reasoning_content" not in message.model_extra and message.content
    chunk = http_client.generate(Prompt(messages=ASK, max_tokens=8, temperature=0.0))
    assert chunk.reasoning_state == "" and chunk.reasoning_output == "" and chunk.text_output


def raw_reply(http_client, tokenizer, messages: list[dict], **template_kwargs):
    """What the model writes for the thinking template's prompt, sent as raw text (never split)."""
    prompt = tokenizer.apply_chat_template(messages, chat_template=THINK_TEMPLATE.read_text(), add_generation_prompt=True,
                                           tokenize=False, **template_kwargs)
    return http_client.generate(Prompt(text_input=prompt, apply_chat_template=False, max_tokens=BUDGET, temperature=0.0))


def chat_stream(client: openai.OpenAI, **request) -> tuple[str, str, str | None]:
    """The streamed reply's reasoning and content, each its deltas joined, and its finish reason."""
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("template_kwargs, state", [({}, INSIDE), (OFF, OUTSIDE)], ids=["thinking", "enable_thinking-false"])
def test_chat_returns_the_split_of_what_the_model_wrote(think, openai_client, http_client, tokenizer, model,
                                                        template_kwargs, state):
    raw = raw_reply(http_client, tokenizer, ASK, **template_kwargs)
    expected = split(raw.text_output, state, finished=True)
    request = dict(model=model, messages=ASK, max_tokens=BUDGET, temperature=0,
                   extra_body={"chat_template_kwargs": template_kwargs} if template_kwargs else None)
    whole = openai_client.chat.completions.create(**request)
    message = whole.choices[0].message
    assert whole.usage.prompt_tokens == raw.prompt_tokens  # the same prompt: chat_template_kwargs reached the template
    assert (message.model_extra.get("reasoning_content", ""), message.content) == (expected.reasoning, expected.content)
    assert "reasoning_content" not in message.model_extra or message.reasoning_content  # absent, never empty
    assert "<think>" not in message.content and "</think>" not in message.content
    assert chat_stream(openai_client, **request) == (expected.reasoning, expected.content, whole.choices[0].finish_reason)
    if state == INSIDE:
        assert expected.reasoning  # the reply opened inside thinking: its first words are thinking


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_that_thinks_then_answers_is_split_there(think, openai_client, model, stream):
    request = dict(model=model, messages=ASK, max_tokens=64, temperature=0, extra_body={"structured_outputs": FORCED})
    if stream:
        reasoning, content, finish = chat_stream(openai_client, **request)
    else:
        choice = openai_client.chat.completions.create(**request).choices[0]
        reasoning, content, finish = choice.message.reasoning_content, choice.message.content, choice.finish_reason
    assert re.fullmatch(THOUGHT, reasoning) and re.fullmatch(ANSWER, content) and finish == "stop"


def test_triton_says_where_the_reply_began_and_returns_what_the_model_wrote(think, generate):
    body = {"messages": json.dumps(ASK), "max_tokens": 64, "temperature": 0.0, "structured_outputs": json.dumps(FORCED)}
    reply = generate(body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["reasoning_state"] == OUTSIDE  # the grammar's reply begins after the prompt's closed block
    assert re.fullmatch(FORCED["regex"], reply.json()["text_output"])
    assert generate({"messages": json.dumps(ASK), "max_tokens": 1}).json()["reasoning_state"] == INSIDE


def test_a_reply_held_to_a_grammar_does_not_think(think, openai_client, model):
    """Tool calls that are required and structured outputs follow their grammar from the first token: the
    prompt's open block is closed for them, and the reply is the call or the object, with no reasoning."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = openai_client.chat.completions.create(model=model, messages=ask, tools=[openai.pydantic_function_tool(Weather)],
                                                 tool_choice="required", max_tokens=80, temperature=0).choices[0]
    assert call.finish_reason == "tool_calls" and "reasoning_content" not in call.message.model_extra
    Weather.model_validate_json(call.message.tool_calls[0].function.arguments)
    parsed = openai_client.responses.parse(model=model, input="Name a warm colour.", text_format=Colour,
                                           max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Colour) and [item.type for item in parsed.output] == ["message"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_client_splits_the_thinking_into_reasoning_output(think, http_client, grpc_client, protocol):
    client = http_client if protocol == "http" else grpc_client
    prompt = Prompt(messages=ASK, max_tokens=64, temperature=0.0, structured_outputs=FORCED)
    whole = client.generate(prompt)
    assert re.fullmatch(THOUGHT, whole.reasoning_output) and re.fullmatch(ANSWER, whole.text_output)
    chunks = list(client.stream(prompt))
    assert "".join(c.reasoning_output for c in chunks) == whole.reasoning_output
    assert "".join(c.text_output for c in chunks) == whole.text_output
    assert len([c for c in chunks if c.reasoning_output]) > 1  # streamed as it is written, not at the end


def test_the_responses_api_returns_a_reasoning_item(think, openai_client, http_client, tokenizer, model):
    expected = split(raw_reply(http_client, tokenizer, ASK).text_output, INSIDE, finished=True)
    request = dict(model=model, input=ASK[0]["content"], max_output_tokens=BUDGET, temperature=0)
    response = openai_client.responses.create(**request)
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and response.output[0].content[0].text == expected.reasoning
    assert response.output_text == expected.content and "<think>" not in response.output_text
    with openai_client.responses.stream(**request) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == expected.reasoning
    assert [item.type for item in final.output] == kinds and final.output[0].content[0].text == expected.reasoning
    # A reasoning item sent back (as the Agents SDK does) is dropped: the prompt is the one without it.
    back = [{"role": "user", "content": ASK[0]["content"]}, response.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": response.output_text or "Paris."}, {"role": "user", "content": "Thanks"}]
    without = [back[0], back[2], back[3]]
    counts = [openai_client.responses.create(model=model, input=i, max_output_tokens=1).usage.input_tokens for i in (back, without)]
    assert counts[0] == counts[1]


def test_the_messages_api_returns_a_thinking_block(think, openai_frontend, http_client, tokenizer, model):
    client = anthropic.Anthropic(base_url=openai_frontend.url, api_key="unused", max_retries=0)
    greedy = {"extra_body": {"temperature": 0.0}}
    expected = split(raw_reply(http_client, tokenizer, ASK).text_output, INSIDE, finished=True)
    message = client.messages.create(model=model, max_tokens=BUDGET, messages=ASK, **greedy)
    assert message.content[0].type == "thinking" and message.content[0].thinking == expected.reasoning
    assert "".join(b.text for b in message.content if b.type == "text") == expected.content
    with client.messages.stream(model=model, max_tokens=BUDGET, messages=ASK, **greedy) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == expected.reasoning and final.content == message.content
    # thinking disabled reaches the template as enable_thinking false; enabled as true (the template's default)
    off = split(raw_reply(http_client, tokenizer, ASK, **OFF).text_output, OUTSIDE, finished=True)
    disabled = client.messages.create(model=model, max_tokens=BUDGET, messages=ASK, thinking={"type": "disabled"}, **greedy)
    assert [b.type for b in disabled.content if b.type == "thinking"] == (["thinking"] if off.reasoning else [])
    assert "".join(b.text for b in disabled.content if b.type == "text") == off.content
    enabled = client.messages.create(model=model, max_tokens=BUDGET, messages=ASK,
                                     thinking={"type": "enabled", "budget_tokens": 16}, **greedy)
    assert enabled.content == message.content
    # a thinking block sent back in an assistant turn is dropped, as the template drops earlier thinking
    turns = [ASK[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                                       {"type": "text", "text": "Paris."}]}, {"role": "user", "content": "Thanks"}]
    plain = [ASK[0], {"role": "assistant", "content": "Paris."}, turns[2]]
    assert (client.messages.count_tokens(model=model, messages=turns).input_tokens
            == client.messages.count_tokens(model=model, messages=plain).input_tokens)


def test_tokenize_counts_with_chat_template_kwargs(think, openai_frontend, openai_client, model):
    counts = []
    for template_kwargs in ({}, OFF):
        extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
        counted = requests.post(f"{openai_frontend.url}/tokenize", json={"model": model, "messages": ASK, **extra},
                                timeout=60).json()["count"]
        used = openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=1, extra_body=extra).usage
        assert counted == used.prompt_tokens
        counts.append(counted)
    assert counts[1] > counts[0]  # enable_thinking false writes the empty block into the prompt


@pytest.mark.parametrize("route, body, param, message", [
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs",
     "the chat template refused them: enable_thinking must be true or false"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs", "may not set ['add_generation_prompt']"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": [1]}, "chat_template_kwargs", "valid dictionary"),
    ("/v1/completions", {"prompt": "Hi", "chat_template_kwargs": {}}, "chat_template_kwargs", "no chat template renders"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8}},
     "thinking.budget_tokens", "must be below max_tokens (8)"),
])
def test_bad_reasoning_fields_name_the_field(think, openai_frontend, model, route, body, param, message):
    reply = requests.post(f"{openai_frontend.url}{route}", json={"model": model, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and param in error["message"]
    assert route == "/v1/messages" or error["param"] == param
