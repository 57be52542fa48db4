"""The pipeline over HTTP generate, KServe v2 infer and gRPC, on a real tritonserver with SmolLM2."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
import tritonclient.http as httpclient

from client import Prompt

QUESTION = "What is the capital of France?"


def call_llm(url: str, input_ids: list[int], max_tokens: int) -> requests.Response:
    """Talk to the llm model directly (decoupled: generate, not infer), to count generated ids exactly."""
    return requests.post(f"{url}/v2/models/llm/generate", json={"input_ids": input_ids, "max_tokens": max_tokens}, timeout=300)


def test_generate_returns_text_output_from_the_real_model(generate):
    reply = generate({"text_input": QUESTION, "max_tokens": 32})
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"].strip()


def test_llm_generates_at_most_max_tokens(http_url, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to fifty."}], add_generation_prompt=True)
    for max_tokens in (1, 5, 12):
        reply = call_llm(http_url, ids, max_tokens)
        assert reply.status_code == 200, reply.text
        ids = reply.json()["output_ids"]
        assert 1 <= len(ids if isinstance(ids, list) else [ids]) <= max_tokens  # one id comes as a scalar


def test_a_shorter_budget_gives_a_prefix_of_the_longer_reply(generate):
    short = generate({"text_input": QUESTION, "max_tokens": 4}).json()["text_output"]
    longer = generate({"text_input": QUESTION, "max_tokens": 24}).json()["text_output"]
    assert short and longer.startswith(short) and len(longer) > len(short)


def test_default_max_tokens_applies_when_absent(generate):
    default = generate({"text_input": "Write a long story about a dragon."}).json()["text_output"]
    explicit = generate({"text_input": "Write a long story about a dragon.", "max_tokens": 64}).json()["text_output"]
    assert default == explicit


def test_greedy_replies_are_deterministic(generate):
    replies = {generate({"text_input": QUESTION, "max_tokens": 16}).json()["text_output"] for _ in range(3)}
    assert len(replies) == 1


def test_kserve_infer_and_grpc_agree_with_generate(generate, http_client, grpc_client):
    expected = generate({"text_input": QUESTION, "max_tokens": 16}).json()["text_output"]
    assert http_client.generate(Prompt(QUESTION, 16)).text_output == expected
    assert grpc_client.generate(Prompt(QUESTION, 16)).text_output == expected


def test_kserve_infer_with_json_tensors(http_url):
    body = {"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [QUESTION]},
        {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [8]},
    ]}
    reply = requests.post(f"{http_url}/v2/models/ensemble_infer/infer", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o["data"][0] for o in reply.json()["outputs"]}
    assert outputs["text_output"].strip() and 1 <= outputs["completion_tokens"] <= 8


def test_raw_prompt_and_system_prompt_change_the_reply(generate):
    chat = generate({"text_input": "Once upon a time", "max_tokens": 16}).json()["text_output"]
    raw = generate({"text_input": "Once upon a time", "max_tokens": 16, "apply_chat_template": False})
    system = generate({"text_input": "Once upon a time", "max_tokens": 16, "system_prompt": "Answer only in French."})
    assert raw.status_code == 200 and system.status_code == 200
    assert len({chat, raw.json()["text_output"], system.json()["text_output"]}) == 3


def test_chinese_and_emoji_replies_are_complete_utf8(generate):
    reply = generate({"text_input": "请用中文和表情符号回答：你最喜欢什么水果？🍎🍌", "max_tokens": 48})
    assert reply.status_code == 200
    reply.content.decode("utf-8")  # strict: the body is valid UTF-8
    text = reply.json()["text_output"]
    assert text.strip() and not text.endswith("\ufffd")


def test_postprocess_never_returns_a_split_character(http_url, tokenizer):
    """Ids cut mid-character on purpose: postprocess still returns whole characters only."""
    text = "你好，世界 😀🌍"
    ids = tokenizer.encode(text)
    fingerprint = requests.post(f"{http_url}/v2/models/preprocess/generate", json={"text_input": "x"}, timeout=60).json()
    for end in range(1, len(ids) + 1):
        body = {"output_ids": ids[:end], "sent_tokens": 0, "completion_tokens": end, "prompt_tokens": 1, "finish_reason": "length",
                "tokenizer_fingerprint": fingerprint["tokenizer_fingerprint"]}
        reply = requests.post(f"{http_url}/v2/models/postprocess/generate", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        decoded = reply.json()["text_output"]
        assert "\ufffd" not in decoded and text.startswith(decoded)


def test_concurrent_prompts_of_different_lengths_share_forward_passes(generate, llm_metric):
    tokens, passes = llm_metric("llm_generation_tokens_total"), llm_metric("llm_forward_passes_total")
    prompts = [f"Tell me {'a very ' * i}short fact about the sea." for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: generate({"text_input": p, "max_tokens": 24, "ignore_eos": True}), prompts))
    assert all(r.status_code == 200 for r in replies)
    tokens, passes = llm_metric("llm_generation_tokens_total") - tokens, llm_metric("llm_forward_passes_total") - passes
    assert tokens == 8 * 24 and passes < tokens / 2, (tokens, passes)


def test_binary_tensor_infer_with_the_tritonclient(http_url):
    client = httpclient.InferenceServerClient(http_url.removeprefix("http://"))
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[QUESTION.encode()]], dtype=np.object_), binary_data=True)
    result = client.infer("ensemble_infer", [text])
    assert result.as_numpy("text_output")[0][0].decode().strip()


def test_ignore_eos_generates_exactly_max_tokens_and_counts_them(generate):
    natural = generate({"text_input": "Say yes.", "max_tokens": 200}).json()
    forced = generate({"text_input": "Say yes.", "max_tokens": 200, "ignore_eos": True}).json()
    assert natural["completion_tokens"] < 200 and forced["completion_tokens"] == 200
    assert forced["text_output"].startswith(natural["text_output"])
