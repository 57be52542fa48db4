"""Who runs in the next forward pass, and who waits.

Waiting requests are admitted strictly first come, first served, while a row and the KV blocks for their
prompt plus ``max_tokens`` are free (blocks of their prompt's prefix found in the prefix cache are
reused, and a block other rows hold costs nothing more); such a request's prefill starts where the
cached prefix ends. Every step carries one token for each decoding row, then prompt
chunks in admission order up to ``max_batched_tokens`` (chunked prefill, as vLLM and Sarathi do): a long
prompt is cut into pieces that ride along with the decode rows, so an admission never stalls the running
streams for a whole prompt.

Overload is refused, never absorbed: past ``max_queued_requests`` waiting, a new request is refused at
once, and one that waited ``max_queue_seconds`` without room leaves with an error, so a burst neither
grows memory without bound nor leaves clients hanging.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from contract.schema import FinishReason
from llm.kv import BLOCK_SIZE, KVManager
from llm.metrics import EngineMetrics
from llm.sequence import Sequence


class Overloaded(RuntimeError):
    """The server is full; the message says which limit, and the client should retry later."""


@dataclass
class Step:
    """What ``schedule`` decided: one forward pass (a token for each decoding row, then ``(sequence,
    count)`` prompt chunks), the rows it admitted for it, and the requests that left since the last step
    (cancelled or expired) with nothing to run."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)  # the rows that get a token from this pass, in logits
    # order: decode rows, then each sequence whose prompt this pass completes

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(count for _, count in self.prefill)


class Scheduler:
    def __init__(self, kv: KVManager, *, max_running: int, max_batched_tokens: int,
                 max_queued_requests: int, max_queue_seconds: float, metrics: EngineMetrics) -> None:
        self.kv = kv
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.max_queued_requests = max_queued_requests
        self.max_queue_seconds = max_queue_seconds
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, prompt in the cache or on its way, in admission order
        self._lock = threading.Lock()  # add() comes from Triton's thread, the rest from the engine's

    def add(self, seq: Sequence) -> None:
        if seq.request.reserved_tokens > self.kv.slots.shape[1]:
            raise ValueError("a request larger than the KV budget can never run; validate() refuses it")
        with self._lock:
            if len(self.waiting) >= self.max_queued_requests:
                self.metrics.overloaded()
                raise Overloaded(
                    f"{len(self.waiting)} requests are already waiting for room in the KV budget "
                    f"(max_queued_requests={self.max_queued_requests}); retry later"
                )
            self.waiting.append(seq)

    def sequences(self) -> list[Sequence]:
        with self._lock:
            return self.running + list(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> Step:
        """The next step: who leaves (cancelled, or expired while waiting), who is admitted, and what runs."""
        self._expire()
        step = Step(finished=self._drop_finished(), admitted=self._admit())
        step.decode = [s for s in self.running if s.prompt_left == 0]
        budget = self.max_batched_tokens - len(step.decode)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prompt_left:
                count = min(seq.prompt_left, budget)
                step.prefill.append((seq, count))
                budget -= count
        step.sampled = step.decode + [s for s, count in step.prefill if count == s.prompt_left]
        return step

    def finish(self, seq: Sequence) -> None:
        """Free a finished (or failed) sequence's row and blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq.row)

    def _expire(self) -> None:
        now = time.perf_counter()
        with self._lock:
            expired = [s for s in self.waiting if not s.finished and now - s.arrived > self.max_queue_seconds]
        for seq in expired:
            seq.finish_reason = FinishReason.OVERLOADED
            seq.error = (f"waited {now - seq.arrived:.0f} s for room in the KV budget "
                         f"(max_queue_seconds={self.max_queue_seconds:g}); retry later")
            self.metrics.overloaded()

    def _drop_finished(self) -> list[Sequence]:
        with self._lock:
            gone = [s for s in self.waiting if s.finished]
            if gone:
                self.waiting = deque(s for s in self.waiting if not s.finished)
        for seq in [s for s in self.running if s.finished]:
            self.finish(seq)
            gone.append(seq)
        return gone

    def _admit(self) -> list[Sequence]:
        """First come, first served, while a row and the blocks for the next request's prompt and reply
        are free; its prefill starts where the prefix it found in the cache ends."""
        admitted = []
        with self._lock:
            while self.waiting and len(self.running) < self.max_running:
                seq, kv = self.waiting[0], self.kv
                prompt = len(seq.request.input_ids)
                computed = kv.computed_blocks(seq.prompt_hashes, prompt)
                if not kv.can_allocate(seq.request.reserved_tokens, computed):
                    break
                self.waiting.popleft()
                seq.row = kv.allocate(seq.request.reserved_tokens, computed, seq.prompt_hashes, seq.request.cache_salt)
                seq.computed_tokens = seq.cached_tokens = len(computed) * BLOCK_SIZE
                self.running.append(seq)
                admitted.append(seq)
                self.metrics.admitted(prompt, prompt if kv.caching else 0, seq.cached_tokens)
        return admitted
