"""Prefix caching on a real server: a conversation's next turn finds its earlier turns in the cache, says so
in usage (OpenAI's ``prompt_tokens_details.cached_tokens``) and in Triton's ``cached_tokens``, and replies
exactly as without the cache: in float32 activations (conftest.server), where a greedy reply depends neither on the
batch nor on what the cache held. A fresh ``cache_salt`` gives the same request without the cache on the
same server."""

from __future__ import annotations

import uuid

import openai
import pytest
import requests

from conftest import metric_value
from llm.kv import BLOCK_SIZE

SYSTEM = ("You are the guide of a travel library. Answer in one short paragraph, name one book in every answer, "
          "and never mention the weather. ") * 4
QUESTIONS = ["Which book tells the story of a river?", "And one about mountains?", "Which of the two is shorter?"]


@pytest.fixture
def client(openai_frontend):
    with openai.OpenAI(base_url=f"{openai_frontend.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def chat(client, messages: list[dict], salt: str, stream: bool = False) -> tuple[str, object]:
    """The reply's text and usage, greedy, 24 tokens."""
    fields = {"model": client.models.list().data[0].id, "messages": messages, "max_tokens": 24, "temperature": 0,
              "extra_body": {"cache_salt": salt}}
    if not stream:
        reply = client.chat.completions.create(**fields)
        return reply.choices[0].message.content, reply.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True}):
        text += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    return "".join(text), usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_turn_finds_the_conversation_so_far_and_replies_as_without_the_cache(client, server, stream):
    salt, messages, asked = uuid.uuid4().hex, [{"role": "system", "content": SYSTEM}], []
    hits = metric_value(server, "llm_prefix_cache_hits_tokens_total")
    queries = metric_value(server, "llm_prefix_cache_queries_tokens_total")
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        text, usage = chat(client, messages, salt, stream)
        cached = usage.prompt_tokens_details.cached_tokens
        uncached_text, uncached = chat(client, messages, uuid.uuid4().hex, stream)  # a salt nothing was cached under
        assert uncached.prompt_tokens_details.cached_tokens == 0 and uncached.prompt_tokens == usage.prompt_tokens
        assert text == uncached_text and usage.completion_tokens == uncached.completion_tokens
        assert cached % BLOCK_SIZE == 0 and cached < usage.prompt_tokens
        if turn == 0:
            assert cached == 0
        else:  # at least every full block of the earlier turn's prompt (its reply's too, as re-tokenized)
            assert cached >= asked[-1].prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        asked.append(usage)
        messages.append({"role": "assistant", "content": text})
    saved = sum(u.prompt_tokens_details.cached_tokens for u in asked)
    assert saved > 0
    assert metric_value(server, "llm_prefix_cache_hits_tokens_total") - hits == saved
    assert metric_value(server, "llm_prefix_cache_queries_tokens_total") - queries == 2 * sum(u.prompt_tokens for u in asked)
    assert metric_value(server, "llm_prefix_cache_blocks") > 0


def test_tritons_api_reports_cached_tokens_and_a_salt_keeps_requests_apart(server):
    url = f"{server.url}/v2/models/ensemble/generate"
    body = {"text_input": "Name three rivers of Europe and say which is longest. " * 4, "max_tokens": 8}
    salts = [uuid.uuid4().hex, uuid.uuid4().hex]
    replies = [requests.post(url, json=body | {"cache_salt": salt}, timeout=120).json() for salt in salts + salts]
    assert [r["cached_tokens"] for r in replies[:2]] == [0, 0]
    prompt = replies[0]["prompt_tokens"]
    assert [r["cached_tokens"] for r in replies[2:]] == [(prompt - 1) // BLOCK_SIZE * BLOCK_SIZE] * 2
    assert len({r["text_output"] for r in replies}) == 1


@pytest.mark.parametrize("salt, message", [("", "cache_salt must be 1 to 256 bytes of UTF-8, got 0"),
                                           ("x" * 257, "cache_salt must be 1 to 256 bytes of UTF-8, got 257")])
def test_a_bad_cache_salt_is_refused_naming_the_field(server, client, salt, message):
    reply = requests.post(f"{server.url}/v2/models/ensemble/generate",
                          json={"text_input": "Hi", "max_tokens": 2, "cache_salt": salt}, timeout=60)
    assert reply.status_code == 400 and message in reply.json()["error"]
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, [{"role": "user", "content": "Hi"}], salt)
