"""In-flight batching: requests join and leave the running batch between forward passes.

A step is four beats, as nano-vllm's and vLLM v1's: the ``Scheduler`` decides what runs (every decoding
row, plus prompt chunks up to a token budget, and the rows it admits for them), the ``ModelRunner`` runs
it as one forward pass over a paged KV cache, the ``BatchSampler`` picks every row's token, and
``update`` applies the results: the keys now in the cache (their full blocks registered in the prefix
cache by the ``KVManager``, so the next request that starts with the same tokens, a conversation's next
turn above all, skips their prefill), each row's new token and its stop conditions. A finished request
leaves at once and frees its blocks for the next one waiting.
"""

from __future__ import annotations

import time
from typing import Callable

from contract.schema import FinishReason
from contract.stops import TextTracker
from llm.grammar import Grammars
from llm.kv import KVManager
from llm.metrics import EngineMetrics
from llm.runner import ModelRunner
from llm.sampling import BatchSampler, Sampled
from llm.scheduler import Scheduler, Step
from llm.sequence import Sequence, TokenLogprobs


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: BatchSampler,
                 decode: Callable[[list[int]], str], metrics: EngineMetrics, grammars: Grammars | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.grammars = grammars
        self.decode = decode
        self.metrics = metrics

    @property
    def kv(self) -> KVManager:
        return self.scheduler.kv

    # Called from any thread.
    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; its grammar, if any, its stop tracking and its prompt's block hashes are made
        here, on the caller's thread (``InvalidInput`` if the grammar cannot serve this model)."""
        request = seq.request
        if request.grammar is not None:
            seq.matcher = self.grammars.matcher(request.grammar)
        seq.stops = TextTracker(self.decode, request.stop, request.sampling.min_tokens)
        seq.prompt_hashes = self.kv.prompt_hashes(request.input_ids, request.cache_salt)
        self.scheduler.add(seq)

    def sequences(self) -> list[Sequence]:
        """Every request the engine holds, admitted first, then waiting in arrival order."""
        return self.scheduler.sequences()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    @property
    def kv_tokens(self) -> int:
        return self.kv.used_tokens

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """Stop ``seq`` before the next step, for ``reason``; its cache blocks go with that step."""
        if not seq.finished:
            seq.error = error  # before the reason: whoever sees it finished reads the error too
            seq.finish_reason = reason

    # Called from the engine thread only.
    def step(self) -> list[Sequence]:
        """Schedule, run, sample, update. Returns the sequences that changed: a new token, or finished
        (cancelled and expired ones included)."""
        step = self.scheduler.schedule()
        sampled = None
        if step.tokens:
            self.metrics.forward(len(step.decode) + len(step.prefill))
            logits = self.runner.run(step)
            sampled = self.sampler.sample(logits, step.sampled)
        return self.update(step, sampled)

    def update(self, step: Step, sampled: Sampled | None) -> list[Sequence]:
        """The step's results: the prompt log-probabilities its new rows ask for (a pass of their own),
        the keys it wrote (full blocks registered), each sampled row's token and stop conditions, and the
        rows that finished freed."""
        for seq in step.finished:
            self.sampler.release(seq)
        for seq in step.admitted:
            if seq.request.prompt_logprobs is not None:
                seq.prompt_token_logprobs = self.runner.prompt_logprobs(seq.request.input_ids, seq.request.prompt_logprobs)
        computed = [(seq, count) for seq, count in step.prefill] + [(seq, 1) for seq in step.decode]
        for seq, count in computed:
            seq.computed_tokens += count
            self.kv.cache_full_blocks(seq.row, seq.computed_tokens, seq.token_at)
        rows = step.sampled if sampled is not None else []
        if sampled is not None:
            first, later, now = [], [], time.perf_counter()
            for seq, token, logprobs in zip(rows, sampled.tokens, sampled.logprobs):
                (later if seq.last_token_at else first).append(now - (seq.last_token_at or seq.arrived))
                seq.last_token_at = now
                self._append(seq, token, logprobs)
                if seq.finished:
                    self.sampler.release(seq)
                    self.scheduler.finish(seq)
            self.metrics.tokens(first, later)
        s = self.scheduler
        self.metrics.step(len(s.running), len(s.waiting), self.kv.used_tokens, self.kv.cached_blocks)
        return step.finished + rows

    def fail_all(self, error: str) -> list[Sequence]:
        """After a failed step (a device error, out of memory) every admitted row is lost; say so. The
        prefix cache goes too: nothing says what the failed step left in the cache."""
        failed = list(self.scheduler.running)
        for seq in failed:
            if not seq.finished:
                seq.finish_reason, seq.error = FinishReason.ERROR, error
            self.sampler.release(seq)
            self.scheduler.finish(seq)
        self.kv.forget()
        return failed

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """``token`` joins ``seq``'s reply, unless it ends it; then its stop conditions, in order."""
        if token in self.sampler.ends(seq):  # the end-of-turn token (unless ignore_eos) or a stop token: not in the reply
            seq.finish_reason = FinishReason.STOP
            return
        seq.output_ids.append(token)
        if logprobs is not None:
            seq.token_logprobs.append(logprobs)
        matcher = seq.matcher
        if matcher is not None and not matcher.consume_token(token):  # its mask let only valid tokens through
            seq.finish_reason, seq.error = FinishReason.ERROR, f"the grammar refused token {token}: {matcher.get_error()}"
        elif matcher is not None and matcher.is_stopped():
            seq.finish_reason = FinishReason.STOP  # the grammar is complete
        elif seq.stops.add(seq.output_ids):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.request.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
