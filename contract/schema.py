"""The pipeline's tensors, declared once: what a client may send, what it gets back, and what the models
pass each other inside the ensemble.

Everything else is derived from this module: the input and output sections of every ``config.pbtxt``
and the field table of docs/api.md (written by ``make generate``, ``contract/generate.py``; a test fails
when one is stale), the client's ``Prompt`` and tensor types, the CLI's flags, llm's range checks and its
glue's inputs, and the OpenAI API's pass-through fields. Adding a request parameter means a ``Field``
here, the engine code that uses it, and ``make generate``. Dependency-free on purpose: the client imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from contract.errors import InvalidInput

# The reply budget: the default when a request has no max_tokens, and the largest accepted. llm's
# config parameters (default_max_tokens, max_tokens_limit) may change both per deployment.
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 512

NUMPY_TYPES = {  # Triton config type -> numpy dtype name (TYPE_STRING travels as numpy objects of bytes)
    "TYPE_STRING": "object", "TYPE_BOOL": "bool", "TYPE_INT32": "int32", "TYPE_INT64": "int64", "TYPE_FP32": "float32",
}
PYTHON_TYPES = {"TYPE_STRING": str, "TYPE_BOOL": bool, "TYPE_INT32": int, "TYPE_INT64": int, "TYPE_FP32": float}


@dataclass(frozen=True)
class Field:
    """One tensor, and for a request field everything said about it anywhere: its type, which models read
    it (``to``: the ensemble routes it to them), its default and range (``check``), whether the OpenAI API
    takes it under the same name, and the help text of the configs, the CLI and docs/api.md."""

    name: str
    data_type: str  # as config.pbtxt spells it: TYPE_STRING, TYPE_INT32, ...
    dims: tuple[int, ...] = (1,)
    to: tuple[str, ...] = ()
    optional: bool = True  # for llm's outputs: whether postprocess may go without it
    help: str = ""
    default: Any = None  # what llm uses when a request leaves it out; None: off, or decided by the server
    low: float | None = None  # the accepted range, [low, high] ((low, high] with low_open) ...
    high: float | str | None = None  # ... high a number, or the name of the deployment's limit
    low_open: bool = False
    count: int | None = None  # a list's (or a JSON object's) most entries; their values are in the range
    openai: bool = False  # the OpenAI API takes it under this name and passes it on as is
    json: Any = None  # a TYPE_STRING holding JSON of this Python type instead of text
    ragged: bool = False  # allow_ragged_batch, in the models that batch requests

    @property
    def wire_type(self) -> str:
        """The KServe v2 datatype a client sends: BYTES, BOOL, INT32, INT64, FP32."""
        return "BYTES" if self.data_type == "TYPE_STRING" else self.data_type.removeprefix("TYPE_")

    @property
    def numpy_type(self) -> str:
        return NUMPY_TYPES[self.data_type]

    @property
    def python_type(self) -> Any:
        """What a Python caller passes: the JSON's type, a list for a ``[-1]`` tensor, else the scalar's."""
        if self.json is not None:
            return self.json
        scalar = PYTHON_TYPES[self.data_type]
        return list[scalar] if self.dims == (-1,) else scalar

    def check(self, value: Any, limits: Mapping[str, float] = {}) -> Any:
        """``value``, or the default when absent; a finite number in range, or ``InvalidInput`` naming the
        field and the range. ``limits`` gives the deployment's values a ``high`` names."""
        if value is None:
            return self.default
        if isinstance(value, (list, dict)):
            if self.count is not None and len(value) > self.count:
                raise InvalidInput(f"{self.name} holds {len(value)} entries; the limit is {self.count}")
            for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
                self._in_range(f"{self.name}[{key!r}]" if isinstance(value, dict) else f"{self.name}[{key}]", item, limits)
            return value
        return self._in_range(self.name, value, limits)

    def _in_range(self, name: str, value: Any, limits: Mapping[str, float]) -> Any:
        if self.low is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"{name} must be a number, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(f"{name} must be a finite number, got {value}")
        high = limits[self.high] if isinstance(self.high, str) else self.high
        if (value <= self.low if self.low_open else value < self.low) or value > high:
            raise InvalidInput(f"{name} must be in {'(' if self.low_open else '['}{self.low}, {high}], got {value}")
        return value

    def range_text(self) -> str:
        """The range as docs/api.md shows it."""
        if self.low is None:
            return ""
        number = lambda x: f"`{x}`" if isinstance(x, str) else str(x) if isinstance(x, int) else f"{x:g}"  # noqa: E731
        entries = f", at most {self.count} entries" if self.count else ""
        return f"{'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}]{entries}"


PRE, LLM = ("preprocess",), ("llm",)
BUDGET = PRE + LLM  # preprocess does not use max_tokens, but its presence lets a request without text_input reach it
SEED_LIMIT = 2**63 - 1
TOP_LOGPROBS_LIMIT = 5  # as OpenAI's legacy completions API allows (its chat API documents 20)
STOP_TOKEN_IDS_LIMIT = 64
LOGIT_BIAS_LIMIT = 300  # tokens one request may bias
CACHE_SALT_BYTES_LIMIT = 256

# A request to ``ensemble`` (streaming) or ``ensemble_infer`` (one response). All optional; a request
# needs text_input or messages. preprocess checks the text fields' limits, llm the rest (``Field.check``).
REQUEST = (
    Field("text_input", "TYPE_STRING", to=PRE, help="the user message (or raw text with apply_chat_template=false), "
          "UTF-8, at most 65,536 bytes (max_input_bytes); required unless messages is given (declared optional "
          "so that preprocess, not Triton 2.51's ensemble, reports its absence)"),
    Field("max_tokens", "TYPE_INT32", to=BUDGET, default=DEFAULT_MAX_TOKENS, low=1, high="max_tokens_limit",
          help="reply budget in tokens (the default and the limit are llm's parameters default_max_tokens and "
          "max_tokens_limit)"),
    Field("system_prompt", "TYPE_STRING", to=PRE, help="system message for the chat template (default: the template's own)"),
    Field("apply_chat_template", "TYPE_BOOL", to=PRE, default=True,
          help="false sends text_input to the model as raw text (completion style) instead of a chat turn"),
    Field("messages", "TYPE_STRING", to=PRE, json=list[dict], help="instead of text_input: a whole conversation as JSON, "
          '[{"role": "system"|"user"|"assistant", "content": "..."}, ...], through the chat template (what '
          "/v1/chat/completions sends); at most 65,536 bytes"),
    Field("temperature", "TYPE_FP32", to=LLM, default=0.0, low=0.0, high=2.0, openai=True,
          help="0 is greedy; higher samples more freely"),
    Field("top_p", "TYPE_FP32", to=LLM, default=1.0, low=0.0, high=1.0, low_open=True, openai=True,
          help="sample from the smallest set of tokens whose probability reaches top_p"),
    Field("top_k", "TYPE_INT32", to=LLM, default=0, low=0, high="vocab_size", openai=True,
          help="sample from the k most likely tokens; 0 means all"),
    Field("min_p", "TYPE_FP32", to=LLM, default=0.0, low=0.0, high=1.0, openai=True, help="sample only from the "
          "tokens at least min_p times as likely as the most likely one (after temperature), as vLLM; 0 is off"),
    Field("repetition_penalty", "TYPE_FP32", to=LLM, default=1.0, low=0.0, high=2.0, low_open=True, openai=True,
          help="above 1 discourages tokens already in the prompt or the reply, as in transformers; 1 is off"),
    Field("presence_penalty", "TYPE_FP32", to=LLM, default=0.0, low=-2.0, high=2.0, openai=True,
          help="OpenAI's: subtracted once from the logit of every token already in the reply"),
    Field("frequency_penalty", "TYPE_FP32", to=LLM, default=0.0, low=-2.0, high=2.0, openai=True,
          help="OpenAI's: subtracted from a token's logit once per time it is already in the reply"),
    Field("seed", "TYPE_INT64", to=LLM, low=0, high=SEED_LIMIT, openai=True,
          help="makes sampling repeatable, whatever the batch"),
    Field("stop", "TYPE_STRING", (-1,), to=LLM, ragged=True, help="strings that end the reply (matched on text, left "
          "out of it): at most max_stop_count (8) of at most max_stop_bytes (128) bytes each"),
    Field("stop_token_ids", "TYPE_INT32", (-1,), to=LLM, ragged=True, low=0, high="max_token_id",
          count=STOP_TOKEN_IDS_LIMIT, openai=True, help="token ids that end the reply with finish_reason stop, as "
          "the end-of-turn token does (left out of the reply)"),
    Field("min_tokens", "TYPE_INT32", to=LLM, default=0, low=0, high="max_tokens_limit", openai=True,
          help="the least tokens the reply has before the end-of-turn token, stop_token_ids or a stop string may "
          "end it (as vLLM: a stop string counts only when it ends after them); at most max_tokens"),
    # int | float: a bias sent as an integer stays one, so every API quotes it back as it was sent
    Field("logit_bias", "TYPE_STRING", to=LLM, json=dict[str, int | float], low=-100.0, high=100.0, count=LOGIT_BIAS_LIMIT,
          openai=True, help='JSON object {"token id": bias}, added to those tokens\' logits before the choice '
          "(greedy too), as OpenAI's: -100 bans a token, 100 forces it"),
    Field("structured_outputs", "TYPE_STRING", to=PRE, json=dict, openai=True, help='JSON object, vLLM\'s: '
          'exactly one of {"json": a JSON schema}, {"json_object": true}, {"regex": "..."}, {"choice": ["a", "b"]}, '
          '{"grammar": "a Lark grammar"}; the reply is valid by construction (cut off by max_tokens, it ends with length)'),
    Field("tools", "TYPE_STRING", to=PRE, json=list[dict], help='JSON list of OpenAI\'s function tools, '
          '[{"type": "function", "function": {"name", "description", "parameters": a JSON schema}}, ...], at most 128: '
          "shown to the model (through the chat template where it renders tools, else described in a system message); "
          "its calls come back in text_output in the template's syntax (contract/tools.py, docs/api.md)"),
    Field("tool_choice", "TYPE_STRING", to=PRE, help="with tools: auto (the default: the model decides), none (no "
          "calls; the tools are not shown), required (at least one call), or the name of the one tool to call; "
          "required and a name are enforced by a grammar"),
    Field("parallel_tool_calls", "TYPE_BOOL", to=PRE, default=True,
          help="with tools: false allows at most one call per reply"),
    Field("chat_template_kwargs", "TYPE_STRING", to=PRE, json=dict, openai=True, help="vLLM's: a JSON object of "
          'extra variables for the chat template, e.g. {"enable_thinking": false} for a thinking model\'s (Qwen3, '
          "SmolLM3); names the template call itself takes (messages, tools, add_generation_prompt, ...) are refused"),
    Field("ignore_eos", "TYPE_BOOL", to=LLM, default=False, openai=True,
          help="true generates exactly max_tokens tokens, past the end-of-turn token (benchmarks and load tests)"),
    Field("cache_salt", "TYPE_STRING", to=LLM, openai=True, help="vLLM's: only requests with the same salt share "
          "prefix-cache blocks, so a tenant's prompts cannot be probed by timing another's (1 to "
          f"{CACHE_SALT_BYTES_LIMIT} bytes)"),
    Field("stream", "TYPE_BOOL", to=LLM, default=False,
          help="ensemble only (ensemble_infer always answers once): true sends the reply a chunk of text at a time"),
    Field("logprobs", "TYPE_BOOL", to=LLM, default=False, help="true returns each generated token's log-probability "
          "(the model's distribution, before sampling settings) in token_logprobs"),
    Field("top_logprobs", "TYPE_INT32", to=LLM, default=0, low=0, high=TOP_LOGPROBS_LIMIT,
          help="with logprobs: this many most likely alternatives of each token"),
    Field("prompt_logprobs", "TYPE_INT32", to=LLM, low=0, high=TOP_LOGPROBS_LIMIT, help="the prompt's own "
          "log-probabilities, each token's given the ones before it, with this many alternatives, in "
          "prompt_token_logprobs (an extra causal pass over the prompt, paid only by the requests that ask)"),
)

# What every response carries (each streamed chunk, or the one reply).
RESPONSE = (
    Field("text_output", "TYPE_STRING", optional=False, help="the whole reply, or when streaming the text this "
          "response adds: no prompt, no special tokens, complete UTF-8"),
    Field("completion_tokens", "TYPE_INT32", optional=False, help="tokens generated so far"),
    Field("prompt_tokens", "TYPE_INT32", optional=False, help="tokens in the prompt, after the chat template"),
    Field("cached_tokens", "TYPE_INT32", optional=False, help="of the prompt tokens, those whose prefill the prefix "
          "cache saved (an earlier request began with them: a conversation's earlier turns, a shared system prompt)"),
    Field("finish_reason", "TYPE_STRING", optional=False, help="empty until the last response: stop (end of turn, "
          "a stop string or a stop token) or length (max_tokens)"),
    Field("stop_reason", "TYPE_STRING", optional=False, help="in the last response, the stop string that ended the "
          "reply (vLLM's stop_reason; Anthropic's stop_sequence); empty otherwise (end of turn, a stop token, length)"),
    Field("token_logprobs", "TYPE_STRING", optional=False, help="with logprobs: a JSON list of the tokens whose text "
          'this response shows, each {"token", "bytes", "logprob", "top_logprobs"} (OpenAI\'s chat shape); empty otherwise'),
    Field("prompt_token_logprobs", "TYPE_STRING", optional=False, help="with prompt_logprobs, in the first response: "
          'the same items for every prompt token (after the chat template), the first with "logprob": null; empty otherwise'),
    Field("reasoning_state", "TYPE_STRING", optional=False, help="for a chat template whose model thinks in "
          "`<think>...</think>`, where the reply began: inside (the prompt opened the block) or outside (the reply may open "
          "one); empty for any other (a template that never thinks, apply_chat_template=false). text_output is what "
          "the model wrote, thinking included: contract/reasoning.py splits it (the client, the OpenAI front end)"),
)

# preprocess -> llm.
PREPROCESS_OUTPUTS = (
    Field("input_ids", "TYPE_INT32", (-1,), optional=False, ragged=True, help="the prompt's token ids"),
    Field("tokenizer_fingerprint", "TYPE_STRING", optional=False, help="a hash of the vocabulary: llm and "
          "postprocess refuse ids from a tokenizer they do not share"),
    Field("structured_outputs", "TYPE_STRING", json=dict, optional=False, help="what the reply must follow, as the "
          "request field: the request's own, or the grammar of the tool calls it asks for; JSON null when free"),
    Field("reasoning_state", "TYPE_STRING", optional=False, help="where the reply begins, as the response field: "
          "decided here, where the prompt is rendered"),
    Field("coalesce", "TYPE_BOOL", optional=False, help="true in the ensemble, where postprocess reports each response "
          "it has finished (ipc/delivery.py): llm then lets a stream's new tokens wait while its previous response is on "
          "its way, and sends them together; a caller of llm alone leaves it out and gets every token as it comes"),
)

# llm -> postprocess. ``optional``: postprocess may go without it.
LLM_OUTPUTS = (
    Field("output_ids", "TYPE_INT32", (-1,), optional=False, ragged=True, help="the tail of the ids generated so "
          "far (no prompt, no EOS) that postprocess needs: sent_tokens of them were covered by earlier responses"),
    Field("sent_tokens", "TYPE_INT32", optional=False),
    Field("completion_tokens", "TYPE_INT32", optional=False, help="every id generated so far"),
    Field("prompt_tokens", "TYPE_INT32", optional=False),
    Field("cached_tokens", "TYPE_INT32", help="of those, found in the prefix cache"),
    Field("finish_reason", "TYPE_STRING", optional=False, help="empty until the last response"),
    Field("tokenizer_fingerprint", "TYPE_STRING", optional=False, help="the model's vocabulary, for postprocess"),
    Field("stop", "TYPE_STRING", (-1,), ragged=True, help="the validated stop strings: postprocess cuts the text "
          "where llm stopped, and holds back a tail that may become one"),
    Field("stop_after", "TYPE_INT32", help="with min_tokens: stop strings count only when they end after this "
          "character of output_ids' text (0: anywhere)"),
    Field("generation_id", "TYPE_STRING", help="<pid>-<n>, unique on the host: what postprocess names when a "
          "client cancels (ipc/cancel.py)"),
    Field("output_logprobs", "TYPE_FP32", (-1, -1), help="a row per output id when logprobs is true (no columns "
          "otherwise): its log-probability, then its top_logprobs alternatives', most likely first ..."),
    Field("top_logprob_ids", "TYPE_INT32", (-1, -1), help="... and their ids"),
    Field("error", "TYPE_STRING", help="empty, except on a final response that ends a stream with a failure: "
          "postprocess, the last step, answers with it (triton_glue/llm_model.py says why not llm)"),
    Field("input_logprobs", "TYPE_FP32", (-1, -1), help="with prompt_logprobs, in the first response: a row per "
          "prompt token, its log-probability (NaN for the first) then its alternatives' ..."),
    Field("input_logprob_ids", "TYPE_INT32", (-1, -1), help="... and its id, then theirs. No rows otherwise"),
    Field("reasoning_state", "TYPE_STRING", help="preprocess's, handed on for the response"),
)


def request_fields(model: str) -> tuple[Field, ...]:
    """The request fields ``model`` reads, in declaration order."""
    return tuple(f for f in REQUEST if model in f.to)


def llm_fields() -> tuple[Field, ...]:
    """What llm reads besides the prompt's ids, the fingerprint, the reasoning state (which it only hands
    on to postprocess) and ``coalesce`` (which the glue reads): its request fields, and from preprocess the
    structured outputs (the request's, or the tool calls' grammar)."""
    return request_fields("llm") + PREPROCESS_OUTPUTS[2:3]


class FinishReason(str, Enum):
    """Why a generation ended. ``stop`` and ``length`` reach clients as ``finish_reason``; the others end
    in an error response whose message says what happened."""

    STOP = "stop"  # end of sequence, or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away or cancelled
    OVERLOADED = "overloaded"  # refused for load after it was accepted (it waited too long for room)
    ERROR = "error"  # the server failed (a forward pass raised, the model unloaded)
    UNAVAILABLE = "unavailable"  # the server stopped before the reply finished (its drain timeout ran out)

    @property
    def failed(self) -> bool:
        return self not in (FinishReason.STOP, FinishReason.LENGTH)

    def __str__(self) -> str:
        return self.value
