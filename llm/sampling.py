"""Per-request token choice: greedy by default, or seeded sampling with temperature, top-k and top-p, after
the request's repetition, presence and frequency penalties."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. The defaults are greedy decoding with no penalty."""

    temperature: float = 0.0  # 0 picks the most likely token
    top_p: float = 1.0  # sample from the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # sample from the k most likely tokens; 0 means all
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the reply
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already in the reply
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token appears in the reply
    seed: int | None = None  # same seed, same prompt, same params: same tokens, whatever the batch

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One per request, with its own random generator: a row's draws never depend on its batch-mates."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    @property
    def plain(self) -> bool:
        """Greedy with no penalty: the batch's one argmax serves this row."""
        p = self.params
        return p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0

    def __call__(self, logits: torch.Tensor, prompt: torch.Tensor, reply: torch.Tensor) -> int:
        """The next token from one row of float32 ``logits``, given the ``prompt`` and ``reply`` ids so far."""
        p = self.params
        if p.repetition_penalty != 1.0:
            # As in transformers' RepetitionPenaltyLogitsProcessor: shrink positive logits, grow negative.
            seen = torch.cat([prompt, reply])
            scores = logits.gather(0, seen)
            scores = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            logits = logits.scatter(0, seen, scores)
        if (p.presence_penalty or p.frequency_penalty) and reply.numel():
            # As OpenAI (and vLLM) define them: on the reply's tokens only, not the prompt's.
            counts = torch.zeros_like(logits).index_add_(0, reply, torch.ones_like(reply, dtype=logits.dtype))
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(0).cumsum(0)
            drop = cumulative - sorted_logits.softmax(0) >= p.top_p  # keep the token that crosses top_p
            logits = logits.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
        probs = logits.softmax(0)
        return int(torch.multinomial(probs, 1, generator=self.generator))
