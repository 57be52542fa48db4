"""In-flight batching: requests join and leave the running batch between decode steps.

The shape follows TGI's ``CausalLM``: a batch owns padded ids, mask and KV cache; new requests are
prefilled together and concatenated in; finished ones are filtered out at once, freeing their rows.
Each request carries its own sampler and stop conditions. Memory is bounded by a KV budget counted in
cache slots (rows x columns of the padded cache): a request is admitted only when the batch, grown to the
longest reservation (prompt + max_tokens) of any member, still fits, so generation never runs out of
room mid-reply. Waiting requests are admitted strictly first come, first served.

Overload is refused, never absorbed: past ``max_queued_requests`` waiting, a new request is refused at
once, and one that waited ``max_queue_seconds`` without room leaves with an error, so a burst neither
grows memory without bound nor leaves clients hanging.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from llm import cache as kv
from llm.sampling import Sampler, SamplingParams
from serving.errors import OVERLOADED
from serving.stops import find_stop


class Overloaded(RuntimeError):
    """The server is full; the message says which limit, and the client should retry later."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: ids within the vocabulary, a reply budget that fits the context."""

    input_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # matched on the decoded text of the reply
    ignore_eos: bool = False  # generate exactly max_tokens tokens (benchmarks, load tests)

    @property
    def reserved_tokens(self) -> int:
        return len(self.input_ids) + self.max_tokens


class Metrics:
    """Engine events for operators. This default records nothing, so the engine needs no server."""

    def admitted(self, prompt_tokens: int) -> None: ...

    def token(self, seconds: float, first: bool) -> None: ...

    def forward(self, rows: int) -> None:
        """One forward pass (a prefill or a decode step) over ``rows`` requests."""

    def step(self, running: int, waiting: int, kv_tokens: int) -> None:
        """After every step, forward pass or not."""

    def rejected(self) -> None:
        """A request refused for overload (queue full, or waited too long)."""


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: what it has generated and, once done, why it stopped."""

    request: GenerationRequest
    handle: Any = None  # the caller's token for this request (a Triton response sender in the server)
    stream: bool = False  # the caller wants every token, not only the end
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, cancelled, rejected (overload) or error
    error: str | None = None
    sent_tokens: int = 0  # output_ids already handed to the caller
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    sampler: Sampler | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def similar_lengths(batch: list[Sequence], waste: float = 0.25) -> list[list[Sequence]]:
    """Split a prefill into groups of similar prompt lengths, each padded by at most ``waste``.

    Prefill is compute-bound, so padding costs as much as real tokens: one pass over prompts of 4 and
    260 tokens computes 520. A group per length band costs an extra pass only when lengths differ.
    """
    groups: list[list[Sequence]] = []
    for seq in sorted(batch, key=lambda s: len(s.request.input_ids)):
        trial = (groups[-1] if groups else []) + [seq]
        if groups and len(seq.request.input_ids) * len(trial) <= (1 + waste) * sum(len(s.request.input_ids) for s in trial):
            groups[-1] = trial
        else:
            groups.append([seq])
    return groups


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_ids: set[int],
        pad_id: int,
        kv_cache_tokens: int,
        max_batch_size: int,
        max_queued_requests: int = 256,
        max_queue_seconds: float = 60.0,
        decode: Callable[[list[int]], str] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.kv_cache_tokens = kv_cache_tokens
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.max_queue_seconds = max_queue_seconds
        self.decode = decode
        self.metrics = metrics or Metrics()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # admitted, not yet in the batch
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (rows, columns) 1 where the cache holds a real token
        self._lock = threading.Lock()  # add() comes from Triton's thread, step() runs on the engine's

    # Called from any thread.
    def add(self, seq: Sequence) -> None:
        if seq.request.reserved_tokens > self.kv_cache_tokens:
            raise ValueError("a request larger than the KV budget can never run; validate() refuses it")
        with self._lock:
            if len(self.waiting) >= self.max_queued_requests:
                self.metrics.rejected()
                raise Overloaded(
                    f"{OVERLOADED}{len(self.waiting)} requests are already waiting for room in the KV budget "
                    f"(max_queued_requests={self.max_queued_requests}); retry later"
                )
            self.waiting.append(seq)

    def sequences(self) -> list[Sequence]:
        """Every request the engine holds, running first, then waiting in arrival order."""
        with self._lock:
            return self.running + list(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_tokens(self) -> int:
        """Cache slots in use now (rows x columns of the padded cache)."""
        return 0 if self.mask is None else self.mask.numel()

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` before the next step; its row and its KV memory go with that step."""
        if not seq.finished:
            seq.finish_reason = "cancelled"

    # Called from the engine thread only.
    def step(self) -> list[Sequence]:
        """One scheduling iteration: admit and prefill what fits, otherwise one decode step for all.

        Returns the sequences that changed: a new token, or finished (cancelled ones included).
        """
        self._expire_waiting()
        changed = self._drop_finished()  # cancelled or expired since the last step
        admitted = self._admit()
        if admitted:
            for group in similar_lengths(admitted):
                changed += self._prefill(group)
                self.metrics.forward(len(group))
        elif self.running:
            self.metrics.forward(len(self.running))
            changed += self._decode()
        self._drop_finished()  # finished in this step: already in changed; their rows go now
        self.metrics.step(len(self.running), len(self.waiting), self.kv_tokens)
        return changed

    def fail_all(self, error: str) -> list[Sequence]:
        """After a failed step (a device error, out of memory) every running row is lost; say so."""
        failed = self.running + self.prefilling
        for seq in failed:
            if not seq.finished:
                seq.finish_reason, seq.error = "error", error
        self.running, self.prefilling, self.cache, self.mask = [], [], None, None
        return failed

    def _expire_waiting(self) -> None:
        now = time.perf_counter()
        with self._lock:
            expired = [s for s in self.waiting if not s.finished and now - s.arrived > self.max_queue_seconds]
        for seq in expired:
            seq.finish_reason = "rejected"
            seq.error = (f"{OVERLOADED}waited {now - seq.arrived:.0f} s for room in the KV budget "
                         f"(max_queue_seconds={self.max_queue_seconds:g}); retry later")
            self.metrics.rejected()

    def _drop_finished(self) -> list[Sequence]:
        with self._lock:
            gone = [s for s in self.waiting if s.finished]
            if gone:
                self.waiting = deque(s for s in self.waiting if not s.finished)
        keep = [i for i, s in enumerate(self.running) if not s.finished]
        gone += [s for s in self.running if s.finished]
        if len(keep) < len(self.running):
            self.running = [self.running[i] for i in keep]
            if keep:
                self.cache, self.mask = kv.select(self.cache, self.mask, keep)
            else:
                self.cache, self.mask = None, None
        return gone

    def _fits(self, batch: list[Sequence]) -> bool:
        widest = max(s.request.reserved_tokens for s in batch)
        return len(batch) <= self.max_batch_size and len(batch) * widest <= self.kv_cache_tokens

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        with self._lock:
            while self.waiting and self._fits(self.running + admitted + [self.waiting[0]]):
                admitted.append(self.waiting.popleft())
        self.prefilling = admitted
        for seq in admitted:
            seq.sampler = Sampler(seq.request.sampling, self.device)
            self.metrics.admitted(len(seq.request.input_ids))
        return admitted

    @torch.inference_mode()
    def _prefill(self, batch: list[Sequence]) -> list[Sequence]:
        width = max(len(s.request.input_ids) for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            prompt = seq.request.input_ids
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        )
        kv.check_layers(cache)
        self._choose(batch, out.logits[:, -1, :])
        if self.running:
            self.cache, self.mask = kv.concat(self.cache, self.mask, cache, mask)
            self.running += batch
        else:
            self.cache, self.mask, self.running = cache, mask, list(batch)
        self.prefilling = [s for s in self.prefilling if s not in batch]
        return batch

    @torch.inference_mode()
    def _decode(self) -> list[Sequence]:
        batch = self.running
        ids = torch.tensor([[s.output_ids[-1]] for s in batch], device=self.device)
        positions = torch.tensor(
            [[len(s.request.input_ids) + len(s.output_ids) - 1] for s in batch], device=self.device
        )
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(batch), 1))], dim=1)
        out = self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache,
            use_cache=True,
        )
        self._choose(batch, out.logits[:, -1, :])
        return list(batch)

    def _choose(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        """Pick each row's next token with its own sampler, then apply its stop conditions."""
        logits = logits.float()
        plain = [i for i, s in enumerate(batch) if s.sampler.params.greedy and s.sampler.params.repetition_penalty == 1.0]
        tokens: dict[int, int] = {}
        if plain:  # one argmax for every greedy row: the common case stays one kernel
            best = logits[plain].argmax(-1).tolist()
            tokens = dict(zip(plain, best))
        now = time.perf_counter()
        for row, seq in enumerate(batch):
            token = tokens.get(row)
            if token is None:
                seen = torch.tensor(seq.request.input_ids + seq.output_ids, device=logits.device)
                token = seq.sampler(logits[row], seen)
            self.metrics.token(now - (seq.last_token_at or seq.arrived), first=seq.last_token_at is None)
            seq.last_token_at = now
            self._append(seq, token)

    def _append(self, seq: Sequence, token: int) -> None:
        request = seq.request
        if token in self.eos_ids and not request.ignore_eos:
            seq.finish_reason = "stop"
            return
        seq.output_ids.append(token)
        if request.stop and self.decode is not None and find_stop(self.decode(seq.output_ids), request.stop) is not None:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= request.max_tokens:
            seq.finish_reason = "length"
