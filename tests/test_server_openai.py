"""The OpenAI-compatible API on a real tritonserver, through the official ``openai`` client and plain HTTP."""

from __future__ import annotations

import http.client
import json
import math
import socket
import time

import openai
import pytest
import requests

from launcher.frontend import OpenAIFrontend

STORY = "Tell me a short story about a lighthouse keeper."
CHAT = [{"role": "user", "content": STORY}]
GREEDY = {"temperature": 0}
DROP = object()  # leaves a field out of a request body


def post(frontend: OpenAIFrontend, path: str, body, headers: dict | None = None, **kwargs) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    kwargs.setdefault("timeout", 300)
    return requests.post(f"{frontend.url}/v1/{path}", data=data,
                         headers={"Content-Type": "application/json", **(headers or {})}, **kwargs)


def error_of(reply: requests.Response) -> dict:
    """The OpenAI error object, checked for its shape."""
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def streamed(client: openai.OpenAI, **kwargs) -> list:
    return list(client.chat.completions.create(model=kwargs.pop("model"), stream=True, **kwargs))


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


# Models and health


def test_models_lists_the_served_model_named_after_its_folder(openai_client, model):
    assert [m.id for m in openai_client.models.list().data] == [model]
    assert openai_client.models.retrieve(model).id == model


def test_an_unknown_model_is_a_404(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_health_follows_the_ensemble(openai_frontend):
    assert requests.get(f"{openai_frontend.url}/health", timeout=30).json() == {"status": "ok"}


# Chat completions


def test_a_chat_completion_is_the_ensembles_reply_with_its_usage(openai_client, model, generate):
    reply = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, **GREEDY)
    ensemble = generate({"text_input": STORY, "max_tokens": 24}).json()
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == ensemble["text_output"]
    assert choice.finish_reason == ensemble["finish_reason"]
    assert reply.usage.prompt_tokens == ensemble["prompt_tokens"]
    assert reply.usage.completion_tokens == ensemble["completion_tokens"]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == model


def test_a_streamed_chat_adds_up_to_the_whole_reply_and_ends_with_usage(openai_client, model):
    whole = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, **GREEDY)
    chunks = streamed(openai_client, model=model, messages=CHAT, max_tokens=24, stream_options={"include_usage": True}, **GREEDY)
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert last.choices == [] and last.usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"})
    # The same prompt again: at least the blocks the first one cached (docs/configuration.md#prefix-caching).
    assert last.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens_details.cached_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == last.id for c in chunks)


def test_continuous_usage_stats_give_the_usage_so_far_in_every_chunk(openai_client, model):
    """vLLM's stream option, which guidellm sends."""
    chunks = streamed(openai_client, model=model, messages=CHAT, max_tokens=12, extra_body={"ignore_eos": True},
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and chunks[-1].choices == []
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_the_stream_is_server_sent_events_ending_with_done(openai_frontend, model):
    reply = post(openai_frontend, "chat/completions", {"model": model, "messages": CHAT, "max_tokens": 4, "stream": True})
    events = [line for line in reply.text.split("\n\n") if line]
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert "usage" not in json.loads(events[0][len("data: "):])  # only with stream_options.include_usage


def test_a_whole_conversation_goes_through_the_chat_template(openai_client, model, tokenizer):
    conversation = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    reply = openai_client.chat.completions.create(model=model, messages=conversation, max_tokens=4)
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert reply.usage.prompt_tokens == len(expected)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour."}]}]
    joined = openai_client.chat.completions.create(model=model, messages=parts, max_tokens=4, **GREEDY)
    plain = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4, **GREEDY)
    assert joined.choices[0].message.content == plain.choices[0].message.content


def test_a_stop_string_ends_the_reply_before_it(openai_client, model):
    free = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, **GREEDY).choices[0].message.content
    words = free.split()
    stop = words[len(words) // 2]
    reply = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, stop=[stop, "@@@"], **GREEDY)
    assert reply.choices[0].message.content == free[: free.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_max_completion_tokens_with_ignore_eos_gives_exactly_that_many(openai_client, model):
    reply = openai_client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=12,
                                                  extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"


def test_a_seed_repeats_a_sampled_reply(openai_client, model):
    ask = lambda: openai_client.chat.completions.create(  # noqa: E731
        model=model, messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.95, seed=1234,
        presence_penalty=0.5, frequency_penalty=0.5, extra_body={"top_k": 50, "repetition_penalty": 1.1})
    assert ask().choices[0].message.content == ask().choices[0].message.content


def test_n_choices_are_the_generations_seeded_seed_and_up(openai_frontend, model):
    client = openai.OpenAI(base_url=f"{openai_frontend.url}/v1", api_key="unused", max_retries=0, timeout=300)
    ask = dict(model=model, messages=CHAT, max_tokens=12, temperature=1.0)
    reply = client.chat.completions.create(n=3, seed=11, **ask)
    alone = [client.chat.completions.create(seed=11 + i, **ask) for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [a.choices[0].message.content for a in alone]
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counts once
    chunks = list(client.chat.completions.create(n=3, seed=11, stream=True, **ask))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.message.content for c in reply.choices]
    client.close()


def test_logprobs_are_log_probabilities_of_the_reply_tokens(openai_client, model):
    reply = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, logprobs=True,
                                                  top_logprobs=3, **GREEDY)
    items = reply.choices[0].logprobs.content
    assert len(items) == reply.usage.completion_tokens
    assert "".join(i.token for i in items) == reply.choices[0].message.content
    for item in items:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-4
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the most likely
        assert item.logprob == pytest.approx(tops[0], abs=1e-5)
        assert item.bytes == list(item.token.encode())
    chunks = streamed(openai_client, model=model, messages=CHAT, max_tokens=16, logprobs=True, top_logprobs=3, **GREEDY)
    for chunk in chunks:  # each chunk's logprobs are the tokens of its own text
        content = chunk.choices[0].logprobs.content
        assert "".join(i.token for i in content) == (chunk.choices[0].delta.content or "")
    assert [i.token for c in chunks for i in c.choices[0].logprobs.content] == [i.token for i in items]


def test_without_logprobs_there_are_none(openai_client, model):
    assert openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].logprobs is None


# Completions (no chat template)


def test_a_completion_continues_the_raw_prompt(openai_client, model, tokenizer):
    prompt = "The capital of France is"
    reply = openai_client.completions.create(model=model, prompt=prompt, max_tokens=8, logprobs=2, **GREEDY)
    (choice,) = reply.choices
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert len(choice.logprobs.tokens) == reply.usage.completion_tokens == len(choice.logprobs.token_logprobs)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0 and "".join(choice.logprobs.tokens) == choice.text
    chunks = list(openai_client.completions.create(model=model, prompt=prompt, max_tokens=8, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_a_list_of_prompts_gives_a_choice_each(openai_client, model):
    reply = openai_client.completions.create(model=model, prompt=["One, two,", "Red, green,"], max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text and reply.choices[2].text == reply.choices[3].text


# Refusals and errors, the OpenAI way


@pytest.mark.parametrize("bias", [{"1": -150}, {"1": 100.5}])
def test_a_pipeline_refusal_reads_the_same_on_the_openai_api_as_on_tritons(openai_frontend, server, model, bias):
    """The number quoted back is the one sent, an integer or not, whichever API carried it."""
    triton = requests.post(f"{server.url}/v2/models/ensemble/generate", timeout=60,
                           json={"text_input": "Hi", "max_tokens": 2, "logit_bias": json.dumps(bias)})
    openai_reply = post(openai_frontend, "chat/completions", {"model": model, "messages": CHAT, "max_tokens": 2,
                                                              "logit_bias": bias})
    assert triton.status_code == openai_reply.status_code == 400
    assert triton.json()["error"].endswith(error_of(openai_reply)["message"]), (triton.text, openai_reply.text)
    assert error_of(openai_reply)["message"].endswith(f"got {bias['1']}")


@pytest.mark.parametrize("body, status, param, message", [
    ("{not json", 400, None, "not valid JSON"),
    ("[1, 2]", 400, None, "must be a JSON object"),
    ({"model": DROP}, 400, "model", "Field required"),
    ({"max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ({"temperature": "hot"}, 400, "temperature", "valid number"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "Input should be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content.0", "this model takes text only; a content part of type 'image_url' cannot be read"),
    ({"n": 9}, 400, "n", "less than or equal to 8"),
    ({"some_field": 1}, 400, "some_field", "Extra inputs are not permitted"),
    ({"functions": [{"name": "f"}]}, 400, "functions", "the deprecated functions field is not supported"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type", None),
    ({"logit_bias": {"x": 5}}, 400, "logit_bias", "logit_bias key 'x' is not a token id"),
    ({"logit_bias": {"1": 101}}, 400, "logit_bias", "logit_bias['1'] must be in [-100.0, 100.0], got 101"),
    ({"min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "min_tokens=9 must not exceed max_tokens=4"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids[0] must be in [0, 49151], got -1"),
    ({"min_p": 1.5}, 400, "min_p", "min_p must be in [0.0, 1.0], got 1.5"),
    ({"audio": {"voice": "alloy"}}, 400, "audio", "not supported"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream=true"),
    ({"max_tokens": 100000}, 400, "max_tokens", "max_tokens must be in [1, 512], got 100000"),
    ({"max_tokens": DROP, "max_completion_tokens": 100000}, 400, "max_completion_tokens",
     "max_completion_tokens must be in [1, 512]"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens", "disagree"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "top_logprobs is only allowed with logprobs=true"),
    ({"top_logprobs": 0}, 400, "top_logprobs", "top_logprobs is only allowed with logprobs=true"),
    ({"logprobs": True, "top_logprobs": 6}, 400, "top_logprobs", "top_logprobs must be in [0, 5], got 6"),
    ({"presence_penalty": 3}, 400, "presence_penalty", "presence_penalty must be in [-2.0, 2.0], got 3.0"),
    ({"temperature": 2.5}, 400, "temperature", "temperature must be in [0.0, 2.0]"),
    ({"stop": ["x"] * 9}, 400, "stop", "stop holds 9 strings; the limit is 8"),
    ({"seed": -1}, 400, "seed", "seed must be in [0,"),
    ({"messages": [{"role": "user", "content": "x" * 70000}]}, 400, "messages", "messages is 7"),
    ({"store": True}, 400, "store", "stored completions are not supported"),
    ({"service_tier": "flex"}, 400, "service_tier", "only the default service tier"),
    ({"model": "nope"}, 404, "model", "does not exist"),
])
def test_client_mistakes_are_openai_errors_naming_the_field(openai_frontend, model, body, status, param, message):
    """Whole and streamed alike: a refusal comes before the first byte of a stream, with its status."""
    for stream in (False,) if isinstance(body, str) or "stream_options" in body else (False, True):
        if isinstance(body, str):
            sent = body
        else:
            sent = {"model": model, "messages": CHAT, "max_tokens": 2, "stream": stream, **body}
            sent = {k: v for k, v in sent.items() if v is not DROP}
        reply = post(openai_frontend, "chat/completions", sent)
        assert reply.status_code == status, (stream, reply.text)
        error = error_of(reply)
        assert error["param"] == param and (message is None or message in error["message"]), error
        assert error["type"] == "invalid_request_error" and "Value error" not in error["message"]


def test_unsupported_completion_fields_are_refused(openai_frontend, model):
    for field, value in (("suffix", "x"), ("best_of", 2), ("prompt", []), ("prompt", [[1, 2]]), ("prompt", ["a"] * 9),
                         ("echo", "yes")):
        reply = post(openai_frontend, "completions", {"model": model, "prompt": "Hi", field: value})
        assert reply.status_code == 400 and error_of(reply)["param"].startswith(field), (field, value, reply.text)


def raw_post(frontend: OpenAIFrontend, path: str, headers: str, chunks: list[bytes] = ()) -> tuple[int, dict]:
    """A POST written on a socket, so a body the server refuses early need not be sent first: the status
    and the JSON of the answer (read once it comes, whatever is left unsent)."""
    port = int(frontend.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n".encode())
        for chunk in chunks:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # it answered and closed: read the answer
                break
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, json.loads(reply.read())


def test_a_body_past_the_limit_is_refused_before_it_is_read(openai_frontend):
    """413, from the Content-Length alone (no byte of the 70 MB is sent) or once a chunked body passes the limit."""
    status, body = raw_post(openai_frontend, "/v1/chat/completions", "Content-Length: 73400353\r\n")
    assert status == 413 and body["error"]["message"] == ("the request body is 73400353 bytes; the limit is 1048576 "
                                                          "bytes (OPENAI_MAX_BODY_BYTES)")
    status, body = raw_post(openai_frontend, "/v1/messages", "Transfer-Encoding: chunked\r\n", [b"x" * 65536] * 48)
    assert status == 413 and body["error"] == {"type": "request_too_large", "message": "the request body passed the "
                                               "limit of 1048576 bytes (OPENAI_MAX_BODY_BYTES)"}


def test_a_prompt_too_long_is_named_as_the_client_sent_it(openai_frontend, model):
    reply = post(openai_frontend, "completions", {"model": model, "prompt": "x" * 70000, "max_tokens": 2})
    error = error_of(reply)
    assert reply.status_code == 400 and error["param"] == "prompt" and error["message"].startswith("prompt is 70000 bytes")
    assert "text_input" not in error["message"]


# What OpenAI accepts, accepted


def test_absent_null_and_off_values_of_fields_this_server_does_not_do_are_accepted(openai_frontend, openai_client, model):
    """As the official client and Triton's own OpenAI test suite send them."""
    reply = openai_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, logit_bias={}, tools=[], parallel_tool_calls=False, store=False,
        metadata={"team": "a"}, service_tier="auto", user="u-1", tool_choice="none", modalities=["text"])
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
    nulls = post(openai_frontend, "chat/completions", {
        "model": model, "messages": CHAT, "max_tokens": 2, "logit_bias": None, "tools": None, "tool_choice": None,
        "functions": None, "function_call": None, "audio": None, "prediction": None, "reasoning_effort": None,
        "response_format": {"type": "text"}, "user": None})
    assert nulls.status_code == 200, nulls.text
    completion = openai_client.completions.create(model=model, prompt="Hi", max_tokens=4, echo=False, best_of=1,
                                                  suffix=None, logit_bias=None, user="u-1")
    assert completion.choices[0].text and completion.usage.completion_tokens == 4


def test_echo_puts_the_prompt_before_the_reply_whole_and_streamed(openai_client, model):
    prompt = "The capital of France is"
    plain = openai_client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    echoed = openai_client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed_text = "".join(c.choices[0].text for c in openai_client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed_text == echoed.choices[0].text


def test_echo_with_logprobs_gives_the_prompts_own_logprobs_first(openai_client, model, generate):
    """As vLLM does: the prompt's tokens (the first with no logprob: nothing comes before it), then the
    reply's; the tokens spell the echoed text, and each alternative list is the model's, best first."""
    prompt = "The capital of France is"
    reply = openai_client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice, usage = reply.choices[0], reply.usage
    lp = choice.logprobs
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c for c in openai_client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                                             echo=True, logprobs=2, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    # Triton's API: the same items, in the first response.
    items = json.loads(generate({"text_input": prompt, "apply_chat_template": False, "max_tokens": 1,
                                 "prompt_logprobs": 0}).json()["prompt_token_logprobs"])
    assert [i["token"] for i in items] == lp.tokens[:usage.prompt_tokens]
    assert [i["logprob"] for i in items[1:]] == pytest.approx(lp.token_logprobs[1:usage.prompt_tokens], abs=1e-5)


def test_a_system_message_alone_is_answered(openai_client, model):
    reply = openai_client.chat.completions.create(
        model=model, max_tokens=8, messages=[{"role": "system", "content": "Greet the user."}])
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 3


def test_a_method_not_allowed_is_an_invalid_request_error(openai_frontend):
    reply = requests.get(f"{openai_frontend.url}/v1/chat/completions", timeout=30)
    assert reply.status_code == 405 and error_of(reply)["type"] == "invalid_request_error"


def test_the_official_client_raises_bad_request_with_the_pipelines_message(openai_client, model):
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be in \[1, 512\]"):
        openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=9999)


def test_an_unknown_route_is_an_openai_404(openai_frontend):
    reply = requests.get(f"{openai_frontend.url}/v1/embeddings", timeout=30)
    assert reply.status_code == 404 and "no route" in error_of(reply)["message"]


# Deadlines, disconnects and metrics


def wait_idle(llm_metric) -> None:
    deadline = time.monotonic() + 30
    while llm_metric("llm_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_request_past_its_deadline_is_a_504_and_frees_its_row(openai_frontend, model, llm_metric):
    long = {"model": model, "messages": CHAT, "max_tokens": 500, "ignore_eos": True}
    started = time.monotonic()
    reply = post(openai_frontend, "chat/completions", long, headers={"X-Request-Timeout": "1.5"})
    assert reply.status_code == 504 and time.monotonic() - started < 10
    assert "deadline of 1.5 s" in error_of(reply)["message"]
    stream = post(openai_frontend, "chat/completions", {**long, "stream": True}, headers={"X-Request-Timeout": "2"})
    events = [e for e in stream.text.split("\n\n") if e]
    assert stream.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "timeout"
    wait_idle(llm_metric)
    assert llm_metric("llm_requests_running") == 0
    bad = post(openai_frontend, "chat/completions", long, headers={"X-Request-Timeout": "soon"})
    assert bad.status_code == 400 and error_of(bad)["param"] == "X-Request-Timeout"


# A reply no model ends early: 512 tokens of a string that must be longer (the APIs without ignore_eos).
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 3000}}, "required": ["text"]}
LONG_BODIES = {
    "chat/completions": {"messages": CHAT, "max_tokens": 512, "ignore_eos": True},
    "responses": {"input": STORY, "max_output_tokens": 512,
                  "text": {"format": {"type": "json_schema", "name": "long", "schema": LONG}}},
    "messages": {"messages": CHAT, "max_tokens": 512, "tools": [{"name": "write", "input_schema": LONG}],
                 "tool_choice": {"type": "any"}},
}


@pytest.mark.parametrize("route", LONG_BODIES)
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_row(openai_frontend, model, llm_metric, stream, route):
    wait_idle(llm_metric)
    before = llm_metric("llm_generation_tokens_total")
    body = {"model": model, **LONG_BODIES[route], "stream": stream}
    try:
        with post(openai_frontend, route, body, stream=True, timeout=3) as reply:
            for _ in zip(range(3), reply.iter_lines()):
                pass  # streaming: the first events; whole: the read times out while llm generates
    except requests.Timeout:
        pass
    wait_idle(llm_metric)
    settled = llm_metric("llm_generation_tokens_total")
    time.sleep(2)
    assert llm_metric("llm_requests_running") == 0
    assert llm_metric("llm_generation_tokens_total") == settled  # nothing generates for the gone client ...
    assert settled - before < 512  # ... which was stopped before its 512 tokens
    log = openai_frontend.log_path.read_text(errors="replace")
    assert "the client went away" in log and "Traceback" not in log  # one line each, no stack


@pytest.fixture(scope="module")
def impatient_frontend(server, model_dir, tmp_path_factory):
    """A front end that resets a client reading nothing for 2 s, with a 4 KiB send buffer."""
    from tests.conftest import running_frontend

    yield from running_frontend(server, model_dir, tmp_path_factory, OPENAI_STALL_TIMEOUT="2",
                                OPENAI_SEND_BUFFER_BYTES="4096")


def test_a_client_that_stops_reading_a_stream_is_reset_and_its_row_freed(impatient_frontend, model, llm_metric):
    """A stream whose client reads nothing (a small receive window, never emptied): once the buffers are
    full for OPENAI_STALL_TIMEOUT, its connection is reset and llm stops generating for it."""
    wait_idle(llm_metric)
    before = llm_metric("llm_generation_tokens_total")
    body = json.dumps({"model": model, "messages": CHAT, "max_tokens": 512, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 5}).encode()  # about 700 bytes an event
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", impatient_frontend.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        assert sock.recv(12) == b"HTTP/1.1 200"  # and then it reads nothing more
        deadline = time.monotonic() + 120
        while "openai_stalled_connections_total 1.0" not in requests.get(f"{impatient_frontend.url}/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "the stuck client was never reset"
            time.sleep(0.5)
        wait_idle(llm_metric)
        assert llm_metric("llm_requests_running") == 0
        assert llm_metric("llm_generation_tokens_total") - before < 512  # stopped before its 512 tokens
    finally:
        sock.close()
    assert post(impatient_frontend, "chat/completions", {"model": model, "messages": CHAT, "max_tokens": 2}).status_code == 200
    log = impatient_frontend.log_path.read_text(errors="replace")
    assert "read nothing for 2 s (OPENAI_STALL_TIMEOUT)" in log and "the client went away" in log
    assert "Traceback" not in log and "ASGI callable" not in log


def test_the_front_end_has_its_own_prometheus_metrics(openai_frontend, openai_client, model):
    openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    text = requests.get(f"{openai_frontend.url}/metrics", timeout=30).text
    for name in ('openai_requests_total{route="/v1/chat/completions",status="200"}', "openai_request_duration_seconds_bucket",
                 "openai_time_to_first_token_seconds_bucket", "openai_prompt_tokens_total", "openai_completion_tokens_total",
                 "openai_requests_in_flight"):
        assert name in text, name


# API keys


@pytest.fixture(scope="module")
def keyed_frontend(server, model_dir, tmp_path_factory):
    from tests.conftest import running_frontend

    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("# one key a line\nfile-key\n")
    yield from running_frontend(server, model_dir, tmp_path_factory, API_KEYS="key-one,key-two", API_KEYS_FILE=str(key_file))


def test_api_keys_guard_v1_and_leave_health_open(keyed_frontend, model):
    body = {"model": model, "messages": CHAT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}):
        reply = post(keyed_frontend, "chat/completions", body, headers)
        assert reply.status_code == 401 and error_of(reply)["code"] == "invalid_api_key"
    for key in ("key-one", "key-two", "file-key"):
        assert post(keyed_frontend, "chat/completions", body, {"Authorization": f"Bearer {key}"}).status_code == 200
    client = openai.OpenAI(base_url=f"{keyed_frontend.url}/v1", api_key="key-two", max_retries=0)
    assert client.models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_frontend.url}/v1", api_key="nope", max_retries=0).models.list()
    assert requests.get(f"{keyed_frontend.url}/health", timeout=30).status_code == 200
    # Anthropic's client sends its key as x-api-key, and hears a refusal in Anthropic's shape.
    import anthropic

    turn = [{"role": "user", "content": "Hi"}]
    claude = anthropic.Anthropic(base_url=keyed_frontend.url, api_key="key-two", max_retries=0)
    assert claude.messages.count_tokens(model=model, messages=turn).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=keyed_frontend.url, api_key="nope", max_retries=0).messages.count_tokens(
            model=model, messages=turn)
    assert refused.value.body["error"]["type"] == "authentication_error"
    for path in ("tokenize", "detokenize"):  # vLLM's paths, outside /v1, guarded all the same
        body = {"prompt": "x"} if path == "tokenize" else {"tokens": [1]}
        assert requests.post(f"{keyed_frontend.url}/{path}", json=body, timeout=30).status_code == 401
        assert requests.post(f"{keyed_frontend.url}/{path}", json=body, timeout=30,
                             headers={"Authorization": "Bearer file-key"}).status_code == 200
