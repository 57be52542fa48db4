"""The pipeline's tensors, declared once: what a client may send, what it gets back, and what the models
pass each other inside the ensemble.

Everything else is derived from or checked against this module: the client's tensor types
(``client.build_inputs``), the inputs ``llm``'s glue reads, and every ``config.pbtxt`` under
``ensemble_repo/`` (``tests/test_repository.py`` fails, naming the tensor, when a config disagrees).
Adding a request parameter means a ``Field`` here, the engine code that uses it, and the config lines
that test then names. Dependency-free on purpose: the client imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# The reply budget: the default when a request has no max_tokens, and the largest accepted. llm's
# config parameters (default_max_tokens, max_tokens_limit) may change both per deployment.
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 512

NUMPY_TYPES = {  # Triton config type -> numpy dtype name (TYPE_STRING travels as numpy objects of bytes)
    "TYPE_STRING": "object", "TYPE_BOOL": "bool", "TYPE_INT32": "int32", "TYPE_INT64": "int64", "TYPE_FP32": "float32",
}


@dataclass(frozen=True)
class Field:
    """One tensor. ``to`` names the models that read a request field (the ensemble routes it to them)."""

    name: str
    data_type: str  # as config.pbtxt spells it: TYPE_STRING, TYPE_INT32, ...
    dims: tuple[int, ...] = (1,)
    to: tuple[str, ...] = ()
    optional: bool = True

    @property
    def wire_type(self) -> str:
        """The KServe v2 datatype a client sends: BYTES, BOOL, INT32, INT64, FP32."""
        return "BYTES" if self.data_type == "TYPE_STRING" else self.data_type.removeprefix("TYPE_")

    @property
    def numpy_type(self) -> str:
        return NUMPY_TYPES[self.data_type]


PRE, LLM = ("preprocess",), ("llm",)

# A request to ``ensemble`` (streaming) or ``ensemble_infer`` (one response). All optional; a request
# needs text_input or messages. The per-field limits live where they are enforced (preprocess, llm).
REQUEST = (
    Field("text_input", "TYPE_STRING", to=PRE),
    Field("max_tokens", "TYPE_INT32", to=PRE + LLM),
    Field("system_prompt", "TYPE_STRING", to=PRE),
    Field("apply_chat_template", "TYPE_BOOL", to=PRE),
    Field("messages", "TYPE_STRING", to=PRE),  # a JSON list of {"role", "content"} (the OpenAI API's)
    Field("temperature", "TYPE_FP32", to=LLM),
    Field("top_p", "TYPE_FP32", to=LLM),
    Field("top_k", "TYPE_INT32", to=LLM),
    Field("repetition_penalty", "TYPE_FP32", to=LLM),
    Field("presence_penalty", "TYPE_FP32", to=LLM),
    Field("frequency_penalty", "TYPE_FP32", to=LLM),
    Field("seed", "TYPE_INT64", to=LLM),
    Field("stop", "TYPE_STRING", (-1,), to=LLM),
    Field("ignore_eos", "TYPE_BOOL", to=LLM),
    Field("stream", "TYPE_BOOL", to=LLM),  # ensemble only: ensemble_infer always answers once
    Field("logprobs", "TYPE_BOOL", to=LLM),
    Field("top_logprobs", "TYPE_INT32", to=LLM),
    Field("prompt_logprobs", "TYPE_INT32", to=LLM),  # the prompt's own, with this many alternatives (0 to 5)
)

# What every response carries (each streamed chunk, or the one reply).
RESPONSE = (
    Field("text_output", "TYPE_STRING", optional=False),
    Field("completion_tokens", "TYPE_INT32", optional=False),
    Field("prompt_tokens", "TYPE_INT32", optional=False),
    Field("finish_reason", "TYPE_STRING", optional=False),  # empty until the last response
    Field("token_logprobs", "TYPE_STRING", optional=False),  # JSON, empty unless logprobs was asked
    Field("prompt_token_logprobs", "TYPE_STRING", optional=False),  # JSON, in the first response of prompt_logprobs
)

# preprocess -> llm.
PREPROCESS_OUTPUTS = (
    Field("input_ids", "TYPE_INT32", (-1,), optional=False),
    Field("tokenizer_fingerprint", "TYPE_STRING", optional=False),
)

# llm -> postprocess.
LLM_OUTPUTS = (
    Field("output_ids", "TYPE_INT32", (-1,), optional=False),
    Field("sent_tokens", "TYPE_INT32", optional=False),
    Field("completion_tokens", "TYPE_INT32", optional=False),
    Field("prompt_tokens", "TYPE_INT32", optional=False),
    Field("finish_reason", "TYPE_STRING", optional=False),
    Field("tokenizer_fingerprint", "TYPE_STRING", optional=False),
    Field("stop", "TYPE_STRING", (-1,), optional=False),
    Field("generation_id", "TYPE_STRING", optional=False),
    Field("output_logprobs", "TYPE_FP32", (-1, -1), optional=False),
    Field("top_logprob_ids", "TYPE_INT32", (-1, -1), optional=False),
    # Empty, or on a final response whose finish_reason is a failure: the error postprocess answers with.
    Field("error", "TYPE_STRING", optional=False),
    # With prompt_logprobs, in the first response: a row per prompt token, its log-probability (NaN for
    # the first) then its alternatives'; and its id, then theirs. No rows otherwise.
    Field("input_logprobs", "TYPE_FP32", (-1, -1), optional=False),
    Field("input_logprob_ids", "TYPE_INT32", (-1, -1), optional=False),
)


def request_fields(model: str) -> tuple[Field, ...]:
    """The request fields ``model`` reads, in declaration order."""
    return tuple(f for f in REQUEST if model in f.to)


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
