"""min_p, min_tokens, logit_bias and stop_token_ids (vLLM's names and meanings) on a real server, through
every way in: Triton's generate, KServe infer (HTTP), gRPC streaming, the CLI and the OpenAI API.

Each check is a property of the model's own greedy reply on the same API, never a hard-coded text: a
token forced by +100 is every token of the reply, the end-of-turn token banned by -100 never ends it,
min_tokens holds back the end-of-turn token, stop tokens and stop strings, min_p=1 is greedy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import GenerationConfig

from client import Prompt
from launcher.paths import REPO_ROOT

SHORT = "Say OK."  # the model's greedy reply ends itself within a few tokens
SENTENCE = "Write one sentence about the sea."
APIS = ["generate", "infer", "grpc", "cli", "openai"]


@pytest.fixture(scope="module")
def token(tokenizer) -> int:
    """A token the model would not choose by itself here."""
    [banana] = tokenizer.encode(" banana", add_special_tokens=False)
    return banana


@pytest.fixture(scope="module")
def eos(model_dir) -> int:
    ids = GenerationConfig.from_pretrained(model_dir).eos_token_id
    return ids if isinstance(ids, int) else ids[0]


@pytest.fixture
def ask(generate, http_client, grpc_client, openai_client, server, model_dir):
    """One greedy reply to ``text`` on ``api``: (text, completion_tokens, finish_reason); the CLI prints
    only the text, so its count and reason are None."""

    def call(api: str, text: str, max_tokens: int, **fields) -> tuple[str, int | None, str | None]:
        fields = {k: v for k, v in fields.items() if v is not None}
        if api == "generate":
            body = {k: json.dumps(v) if k == "logit_bias" else v for k, v in fields.items()}
            reply = generate({"text_input": text, "max_tokens": max_tokens, **body})
            assert reply.status_code == 200, reply.text
            data = reply.json()
            return data["text_output"], data["completion_tokens"], data["finish_reason"]
        if api == "infer":
            chunk = http_client.generate(Prompt(text, max_tokens, **fields))
            return chunk.text_output, chunk.completion_tokens, chunk.finish_reason
        if api == "grpc":
            chunks = list(grpc_client.stream(Prompt(text, max_tokens, **fields)))
            return "".join(c.text_output for c in chunks), chunks[-1].completion_tokens, chunks[-1].finish_reason
        if api == "cli":
            flags = [f"--{k.replace('_', '-')}={json.dumps(v) if k == 'logit_bias' else v}" for k, v in fields.items()
                     if not isinstance(v, list)]
            flags += [f"--{k.replace('_', '-')}={item}" for k, v in fields.items() if isinstance(v, list) for item in v]
            result = subprocess.run(
                [sys.executable, "-m", "client", text, "--url", f"127.0.0.1:{server.ports.grpc}", "--protocol", "grpc",
                 "--max-tokens", str(max_tokens), *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr
            return result.stdout.removesuffix("\n"), None, None
        openai_fields = {k: fields.pop(k) for k in ("logit_bias", "stop", "temperature", "seed") if k in fields}
        reply = openai_client.chat.completions.create(
            model=model_dir.name, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            **{"temperature": 0, **openai_fields}, extra_body=fields)
        choice = reply.choices[0]
        return choice.message.content, reply.usage.completion_tokens, choice.finish_reason

    return call


@pytest.mark.parametrize("api", APIS)
def test_logit_bias_of_100_forces_a_token(ask, tokenizer, token, api):
    text, count, reason = ask(api, SHORT, 4, logit_bias={str(token): 100})
    assert text == tokenizer.decode([token] * 4)
    assert (count, reason) in ((4, "length"), (None, None))


@pytest.mark.parametrize("api", APIS)
def test_logit_bias_of_minus_100_bans_the_end_of_turn_token(ask, eos, api):
    plain, count, reason = ask(api, SHORT, 48)
    if count is not None:
        assert reason == "stop" and count < 48  # the premise: left alone, the model ends its reply early
    banned, count, reason = ask(api, SHORT, 48, logit_bias={str(eos): -100})
    assert len(banned) > len(plain) and banned.startswith(plain)
    assert (count, reason) in ((48, "length"), (None, None))


@pytest.mark.parametrize("api", APIS)
def test_stop_token_ids_end_the_reply_with_stop(ask, token, api):
    """The forced token is a stop token: the reply ends at once, the token left out, as at end of turn;
    with min_tokens=3 the stop token is held back for three tokens and then ends the reply."""
    assert ask(api, SHORT, 8, logit_bias={str(token): 100}, stop_token_ids=[token])[0] == ""
    text, count, reason = ask(api, SHORT, 8, logit_bias={str(token): 100}, stop_token_ids=[token], min_tokens=3)
    assert text and (count, reason) in ((3, "stop"), (None, None))


@pytest.mark.parametrize("api", APIS)
def test_min_tokens_holds_back_the_end_of_turn_token(ask, api):
    plain, count, _ = ask(api, SHORT, 48)
    longer, at_least, reason = ask(api, SHORT, 48, min_tokens=24)
    assert longer.startswith(plain) and len(longer) > len(plain)
    if count is not None:
        assert count < 24 <= at_least and reason in ("stop", "length")


@pytest.mark.parametrize("api", ["generate", "grpc", "openai"])
def test_min_tokens_holds_back_stop_strings_until_reached(ask, api):
    """A stop string counts only when it ends after the first min_tokens tokens: the reply goes on past
    the spaces before that, and still stops at (and leaves out) a later one. Streamed (gRPC) the same."""
    whole, _, _ = ask(api, SENTENCE, 48, ignore_eos=True)
    first_word, _, reason = ask(api, SENTENCE, 48, stop=[" "])
    assert reason == "stop" and " " not in first_word
    text, count, reason = ask(api, SENTENCE, 48, stop=[" "], min_tokens=8)
    assert reason == "stop" and 8 <= count < 48
    assert whole.startswith(text) and whole[len(text)] == " " and text.count(" ") >= 2


@pytest.mark.parametrize("api", APIS)
def test_min_p_of_one_samples_only_the_most_likely_token(ask, api):
    greedy, _, _ = ask(api, SENTENCE, 16)
    for seed in (1, 2):
        assert ask(api, SENTENCE, 16, temperature=1.0, min_p=1.0, seed=seed)[0] == greedy


def test_a_sampled_min_p_reply_is_repeatable_under_a_seed(ask):
    replies = {ask("generate", SENTENCE, 16, temperature=1.0, min_p=0.1, seed=5)[0] for _ in range(2)}
    assert len(replies) == 1
