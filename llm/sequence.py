"""What the engine holds for each request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from contract.schema import FinishReason
from contract.stops import TextTracker
from llm.request import GenerationRequest


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability under the model (before sampling settings), and the most likely
    alternatives at its position, most likely first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: what it has generated, how far its keys are in the cache, and why
    it stopped. Its blocks are the KV manager's (``llm/kv.py``), its sampling state the batch sampler's
    (``llm/sampling.py``), both under ``row``."""

    request: GenerationRequest
    stops: TextTracker | None = None  # its stop strings and min_tokens on the reply's text, from ``Engine.add``
    matcher: Any = None  # its grammar's matcher (llguidance), built by ``Engine.add``
    prompt_hashes: list[bytes] = field(default_factory=list)  # its prompt's full blocks', from ``Engine.add``
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output id, when the request asks
    prompt_token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per prompt id after the first, if asked
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    row: int = 0  # its row of the cache table and of the sampler once admitted; 0 before
    computed_tokens: int = 0  # positions whose keys and values are in the cache (vLLM's num_computed_tokens)
    cached_tokens: int = 0  # of them, prompt tokens found in the prefix cache when it was admitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.request.input_ids) - self.computed_tokens)

    def token_at(self, position: int) -> int:
        prompt = self.request.input_ids
        return prompt[position] if position < len(prompt) else self.output_ids[position - len(prompt)]
