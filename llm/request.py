"""A request as the engine takes it, and the one place it is validated: with a deployment's limits, no model.

Every range comes from the request's ``Field`` in ``contract/schema.py`` (``Field.check``); what a
deployment decides (its vocabulary, the room one request may hold, the reply budget, the stop-string
limits) comes in ``Limits``. A field of ``SamplingParams`` is filled from the request field of its name,
so a new sampling parameter is a ``Field``, a ``SamplingParams`` attribute and the sampler's code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, get_origin

from contract.errors import InvalidInput, decode_utf8
from contract.schema import CACHE_SALT_BYTES_LIMIT, PYTHON_TYPES, llm_fields
from contract.grammar import llguidance_grammar

FIELDS = {f.name: f for f in llm_fields()}


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. The defaults are greedy decoding with no penalty."""

    temperature: float = 0.0  # 0 picks the most likely token
    top_p: float = 1.0  # sample from the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # sample from the k most likely tokens; 0 means all
    min_p: float = 0.0  # sample from the tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the reply
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already in the reply
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token appears in the reply
    seed: int | None = None  # same seed, same prompt, same params: same tokens, whatever the batch
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits before the choice
    min_tokens: int = 0  # no end-of-turn token, stop token or stop string before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the reply as the end-of-turn token does

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SAMPLING = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: ids within the vocabulary, a reply budget that fits the context."""

    input_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # matched on the decoded text of the reply
    ignore_eos: bool = False  # generate exactly max_tokens tokens (benchmarks, load tests)
    top_logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely (0..5)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    grammar: str | None = None  # llguidance's grammar the reply must follow (structured_outputs)
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks

    @property
    def reserved_tokens(self) -> int:
        return len(self.input_ids) + self.max_tokens


@dataclass(frozen=True)
class Limits:
    """What a deployment allows one request: its model's vocabulary and what ``llm``'s config says."""

    vocab_size: int
    room: int  # prompt + reply tokens one request may hold: the model context or the KV budget
    default_max_tokens: int
    max_tokens_limit: int
    max_stop_count: int
    max_stop_bytes: int
    fingerprint: str | None = None  # the model's vocabulary; None accepts ids from any tokenizer


def _scalar(name: str, value: Any, limits: Limits) -> Any:
    """A field's value as its Python type (a list as a tuple), checked against its range, or its default."""
    field = FIELDS[name]
    if value is not None and field.json is not None:
        value = _json(name, value)  # JSON null is absent, as in OpenAI's API
        if value is not None and not isinstance(value, get_origin(field.json) or field.json):
            raise InvalidInput(f"{name} must be a JSON {'object' if get_origin(field.json) is dict else 'list'}, got {value!r}"[:200])
    elif value is not None and field.dims == (-1,):
        value = [PYTHON_TYPES[field.data_type](v) for v in value]
    elif value is not None:
        value = PYTHON_TYPES[field.data_type](value)
    value = field.check(value, {"vocab_size": limits.vocab_size, "max_token_id": limits.vocab_size - 1,
                                "max_tokens_limit": limits.max_tokens_limit})
    return tuple(value) if isinstance(value, list) else value


def _json(name: str, raw: Any) -> Any:
    """A JSON field's value: the text a Triton client sent, or what a Python caller passed."""
    if isinstance(raw, bytes):
        raw = decode_utf8(name, raw)
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{name} is not valid JSON: {e}") from None


def _token_id(name: str, key: Any, limits: Limits) -> int:
    """A JSON object's key that names a token: an integer in the vocabulary (JSON keys are strings)."""
    try:
        token = int(key)
    except ValueError:
        raise InvalidInput(f"{name} key {key!r} is not a token id") from None
    if not 0 <= token < limits.vocab_size:
        raise InvalidInput(f"{name} key {key!r} is outside the model vocabulary [0, {limits.vocab_size})")
    return token


def validate(limits: Limits, input_ids: list[int], max_tokens: int | None = None, *,
             stop: list[bytes] | None = None, tokenizer_fingerprint: str | None = None, **values: Any) -> GenerationRequest:
    """A ``GenerationRequest``, or ``InvalidInput`` naming the field, the value and the range. ``values``
    are the other request fields ``llm`` reads, by name (absent or None: the field's default)."""
    unknown = set(values) - FIELDS.keys() - {"stream"}
    if unknown:
        raise TypeError(f"validate() got unknown request fields {sorted(unknown)}")
    if tokenizer_fingerprint is not None and limits.fingerprint is not None and tokenizer_fingerprint != limits.fingerprint:
        raise InvalidInput(
            f"tokenizer_fingerprint {tokenizer_fingerprint!r} does not match the llm model's vocabulary "
            f"({limits.fingerprint!r}): preprocess's tokenizer must share the model's vocabulary"
        )
    max_tokens = limits.default_max_tokens if max_tokens is None else _scalar("max_tokens", max_tokens, limits)
    sampling = {name: _scalar(name, values.get(name), limits) for name in SAMPLING}
    if sampling["logit_bias"] is not None:  # {"token id": bias} as (id, bias) pairs
        sampling["logit_bias"] = tuple(sorted((_token_id("logit_bias", key, limits), float(bias))
                                              for key, bias in sampling["logit_bias"].items()))
    sampling = SamplingParams(**{name: value for name, value in sampling.items() if value is not None})
    if sampling.min_tokens > max_tokens:
        raise InvalidInput(f"min_tokens={sampling.min_tokens} must not exceed max_tokens={max_tokens}")
    top_logprobs = _scalar("top_logprobs", values.get("top_logprobs"), limits)
    logprobs = _scalar("logprobs", values.get("logprobs"), limits)
    if top_logprobs and not logprobs:
        raise InvalidInput(f"top_logprobs={top_logprobs} needs logprobs=true")
    prompt_logprobs = _scalar("prompt_logprobs", values.get("prompt_logprobs"), limits)
    if not input_ids:
        raise InvalidInput("input_ids must not be empty")
    bad = next((i for i in input_ids if not 0 <= i < limits.vocab_size), None)
    if bad is not None:
        raise InvalidInput(
            f"input_ids holds token id {bad}, outside the model vocabulary [0, {limits.vocab_size}): "
            "the tokenizer in preprocess does not match the llm model"
        )
    if len(input_ids) + max_tokens > limits.room:
        raise InvalidInput(
            f"prompt is {len(input_ids)} tokens; with max_tokens={max_tokens} it exceeds the {limits.room} tokens "
            "one request may hold (the model context or kv_cache_tokens): shorten the prompt or lower max_tokens"
        )
    return GenerationRequest(list(input_ids), max_tokens, sampling, _stop(stop or [], limits),
                             _scalar("ignore_eos", values.get("ignore_eos"), limits),
                             top_logprobs if logprobs else None, prompt_logprobs,
                             _grammar(_scalar("structured_outputs", values.get("structured_outputs"), limits)),
                             _cache_salt(values.get("cache_salt")))


def _cache_salt(raw: str | bytes | None) -> str | None:
    if raw is None:
        return None
    text = decode_utf8("cache_salt", raw) if isinstance(raw, bytes) else raw
    if not text or len(text.encode()) > CACHE_SALT_BYTES_LIMIT:
        raise InvalidInput(f"cache_salt must be 1 to {CACHE_SALT_BYTES_LIMIT} bytes of UTF-8, got {len(text.encode())}")
    return text


def _grammar(spec: dict | None) -> str | None:
    """The grammar a ``structured_outputs`` object asks for (``llm/grammar.py``), or None."""
    return None if spec is None else llguidance_grammar(spec)


def _stop(stop: list[bytes], limits: Limits) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_count:
        raise InvalidInput(f"stop holds {len(stop)} strings; the limit is {limits.max_stop_count} (max_stop_count)")
    texts = []
    for i, raw in enumerate(stop):
        if len(raw) > limits.max_stop_bytes:
            raise InvalidInput(f"stop[{i}] is {len(raw)} bytes; the limit is {limits.max_stop_bytes} (max_stop_bytes)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"stop[{i}] is not valid UTF-8") from None
        if not text:
            raise InvalidInput(f"stop[{i}] must not be empty")
        texts.append(text)
    return tuple(texts)
