"""What the engine holds for each request, and the events it reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from contract.schema import FinishReason
from contract.stops import TextTracker
from llm.request import GenerationRequest
from llm.sampling import Sampler


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability under the model (before sampling settings), and the most likely
    alternatives at its position, most likely first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class Overloaded(RuntimeError):
    """The server is full; the message says which limit, and the client should retry later."""


class Metrics:
    """Engine events for operators. This default records nothing, so the engine needs no server."""

    def admitted(self, prompt_tokens: int, queried_tokens: int, cached_tokens: int) -> None:
        """A request took a row: its prompt, of which ``queried_tokens`` were looked up in the prefix cache
        (all, or none while it is off) and ``cached_tokens`` found there."""

    def tokens(self, first: list[float], later: list[float]) -> None:
        """One step's new tokens: seconds from arrival to a request's first token, and between later ones."""

    def forward(self, rows: int) -> None:
        """One forward pass over ``rows`` requests."""

    def step(self, running: int, waiting: int, kv_tokens: int, cached_blocks: int) -> None:
        """After every step, forward pass or not."""

    def overloaded(self) -> None:
        """A request refused for overload (queue full, or waited too long)."""

    def flush(self) -> None:
        """Hand what was recorded to wherever it goes (called off the decode loop)."""


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: where it is in the cache, what it has generated and why it stopped."""

    request: GenerationRequest
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output id, when the request asks
    prompt_token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per prompt id after the first, if asked
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    sampler: Sampler | None = None
    matcher: Any = None  # its grammar's matcher (llguidance), built when it is submitted
    text: TextTracker | None = None
    row: int = 0  # its row of the block table once admitted
    cached: int = 0  # positions whose keys and values are in the cache
    cached_tokens: int = 0  # prompt tokens whose keys it found in the prefix cache when admitted
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far (``llm/kv.py``)
    registered: int = 0  # its blocks in the prefix cache, found there or registered once full

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.request.input_ids) - self.cached)

    def token_at(self, position: int) -> int:
        prompt = self.request.input_ids
        return prompt[position] if position < len(prompt) else self.output_ids[position - len(prompt)]
