"""``/tokenize`` and ``/detokenize`` on a real tritonserver: the pipeline's own counts (equal to the usage of
the same prompt or messages sent to ``/v1``), vLLM's shapes, and errors that name the field."""

from __future__ import annotations

import json

import openai
import requests
from pydantic import BaseModel

from launcher.frontend import OpenAIFrontend

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


def post(frontend: OpenAIFrontend, path: str, body: dict) -> requests.Response:
    return requests.post(f"{frontend.url}/{path}", json=body, timeout=120)


def error_of(reply: requests.Response, status: int = 400) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


class Weather(BaseModel):
    """The weather in a city."""

    city: str
    unit: str = "celsius"


def test_a_prompts_count_is_the_usage_of_the_same_completion(openai_frontend, openai_client, model_dir):
    prompt = "The three primary colors are"
    reply = post(openai_frontend, "tokenize", {"model": model_dir.name, "prompt": prompt}).json()
    usage = openai_client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=1).usage
    assert reply["count"] == len(reply["tokens"]) == usage.prompt_tokens
    assert reply["max_model_len"] == json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    assert reply["token_strs"] is None


def test_messages_count_as_the_same_chat_completion_with_the_template_and_tools(openai_frontend, openai_client, model_dir):
    for tools in (None, [openai.pydantic_function_tool(Weather)]):
        body = {"messages": CHAT} | ({"tools": tools} if tools else {})
        reply = post(openai_frontend, "tokenize", body).json()  # model is optional, as vLLM's
        usage = openai_client.chat.completions.create(model=model_dir.name, max_tokens=1, **body).usage
        assert reply["count"] == len(reply["tokens"]) == usage.prompt_tokens
    plain = post(openai_frontend, "tokenize", {"messages": CHAT}).json()["count"]
    assert reply["count"] > plain  # the tool's schema is in the template's prompt


def test_detokenize_gives_back_the_text_of_tokenized_ids(openai_frontend):
    text = "Lighthouses guide ships at night. Ünïcödé and emoji 🌊 survive too."
    ids = post(openai_frontend, "tokenize", {"prompt": text}).json()["tokens"]
    assert post(openai_frontend, "detokenize", {"tokens": ids}).json() == {"prompt": text}
    assert post(openai_frontend, "detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_what_the_pipeline_would_not_count_is_refused_by_name(openai_frontend, model_dir):
    cases = [({"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
             ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
             ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
             ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
             ({"prompt": "x", "return_token_strs": True}, "return_token_strs")]
    for body, field in cases:
        error = error_of(post(openai_frontend, "tokenize", body))
        assert error["param"] == field and error["code"] == "unsupported_field" and field in error["message"], error


def test_bad_input_names_the_field_and_the_limit(openai_frontend, model_dir):
    error = error_of(post(openai_frontend, "tokenize", {"prompt": "  "}))
    assert error["param"] == "prompt" and error["message"] == "prompt must not be empty"
    error = error_of(post(openai_frontend, "tokenize", {"prompt": "x" * 70_000}))
    assert error["param"] == "prompt" and "the limit is 65536 bytes" in error["message"]
    error = error_of(post(openai_frontend, "tokenize", {"messages": [{"role": "robot", "content": "hi"}]}))
    assert error["param"] == "messages.0.role"
    assert error_of(post(openai_frontend, "tokenize", {"prompt": 5}))["param"] == "prompt"
    assert error_of(post(openai_frontend, "tokenize", {"prompt": "x", "model": "gpt-4o"}), 404)["code"] == "model_not_found"
    error = error_of(post(openai_frontend, "detokenize", {"tokens": [1, -1]}))
    assert error["param"] == "tokens.1" and "greater than or equal to 0" in error["message"]
    error = error_of(post(openai_frontend, "detokenize", {"tokens": [1, 2**40]}))
    assert error["param"] == "tokens.1"
    error = error_of(post(openai_frontend, "detokenize", {"tokens": [1, 10_000_000]}))
    assert error["param"] == "tokens" and "outside the tokenizer vocabulary of 49152" in error["message"], error
    error = error_of(post(openai_frontend, "detokenize", {"tokens": [1] * 131073}))
    assert error["param"] == "tokens" and "the limit is 131072" in error["message"]
