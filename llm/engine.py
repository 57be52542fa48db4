"""In-flight batching: requests join and leave the running batch between forward passes.

A step reads as nano-vllm's three beats: the ``Scheduler`` decides what runs (every decoding row, plus
prompt chunks up to a token budget), the ``ModelRunner`` runs it as one forward pass over a paged KV cache,
and ``Engine._postprocess`` picks each row's token with its own sampler and applies its stop conditions.
A finished request leaves at once and frees its cache blocks for the next one waiting. Each block a
step fills is registered in the prefix cache (``llm/kv.py``), so the next request that starts with the
same tokens, a conversation's next turn above all, skips their prefill.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from contract.schema import FinishReason
from contract.stops import TextTracker
from llm.grammar import Grammars
from llm.kv import BLOCK_SIZE, BlockHasher
from llm.runner import ModelRunner
from llm.sampling import Sampler, sample
from llm.scheduler import Scheduler, Step
from llm.sequence import Metrics, Sequence, TokenLogprobs


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, eos_ids: set[int],
                 decode: Callable[[list[int]], str], metrics: Metrics, grammars: Grammars | None = None,
                 hasher: BlockHasher | None = None) -> None:
        """``hasher`` turns prefix caching on."""
        self.runner = runner
        self.hasher = hasher
        self.grammars = grammars
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.decode = decode
        self.metrics = metrics
        self.device = runner.device

    # Called from any thread.
    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; its grammar, if any, and its prompt's block hashes are made here, on the
        caller's thread (``InvalidInput`` if the grammar cannot serve this model)."""
        request = seq.request
        if request.grammar is not None:
            seq.matcher = self.grammars.matcher(request.grammar)
        if self.hasher is not None:
            seq.block_hashes = self.hasher.chain(self.hasher.root(request.cache_salt), request.input_ids)
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
        return self.scheduler.blocks.used_tokens

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """Stop ``seq`` before the next step, for ``reason``; its cache blocks go with that step."""
        if not seq.finished:
            seq.error = error  # before the reason: whoever sees it finished reads the error too
            seq.finish_reason = reason

    # Called from the engine thread only.
    def step(self) -> list[Sequence]:
        """Schedule, run one forward pass, postprocess. Returns the sequences that changed: a new token,
        or finished (cancelled and expired ones included)."""
        step, changed = self.scheduler.schedule(self._admitted)
        if step.tokens:
            self.metrics.forward(len(step.decode) + len(step.prefill))
            logits = self.runner.run(step)
            changed += self._postprocess(step, logits)
        s = self.scheduler
        self.metrics.step(len(s.running), len(s.waiting), s.blocks.used_tokens, s.blocks.cached_blocks)
        return changed

    def fail_all(self, error: str) -> list[Sequence]:
        """After a failed step (a device error, out of memory) every admitted row is lost; say so. The
        prefix cache goes too: nothing says what the failed step left in the cache."""
        failed = list(self.scheduler.running)
        for seq in failed:
            if not seq.finished:
                seq.finish_reason, seq.error = FinishReason.ERROR, error
            self.scheduler.finish(seq)
        self.scheduler.blocks.forget()
        return failed

    def _admitted(self, seq: Sequence) -> None:
        request = seq.request
        seq.sampler = Sampler(request.sampling, self.device, frozenset() if request.ignore_eos else frozenset(self.eos_ids),
                              seq.matcher)
        seq.text = TextTracker(self.decode, request.stop, request.sampling.min_tokens)
        if seq.request.prompt_logprobs is not None:
            seq.prompt_token_logprobs = self._prompt_logprobs(seq.request.input_ids, seq.request.prompt_logprobs)
        prompt_tokens = len(seq.request.input_ids)
        self.metrics.admitted(prompt_tokens, prompt_tokens if self.hasher is not None else 0, seq.cached_tokens)

    @torch.inference_mode()
    def _prompt_logprobs(self, ids: list[int], k: int) -> list[TokenLogprobs]:
        """Each prompt token after the first: its log-probability given the ones before it (the model's
        own distribution, as for generated tokens) and the ``k`` most likely tokens there."""
        tokens = torch.tensor(ids, device=self.device)
        logprobs = self.runner.decoder.prompt_logits(tokens)[:-1].log_softmax(-1)
        chosen = logprobs.gather(1, tokens[1:, None])[:, 0].tolist()
        best = logprobs.topk(k, -1) if k else None
        return [TokenLogprobs(lp, best.indices[i].tolist() if k else [], best.values[i].tolist() if k else [])
                for i, lp in enumerate(chosen)]

    def _postprocess(self, step: Step, logits: torch.Tensor) -> list[Sequence]:
        """Each sampled row's token, its stop conditions, and freeing the rows that finished."""
        rows = step.sampled
        for seq, count in step.prefill:
            seq.cached += count
            self._register(seq)
        for seq in step.decode:
            seq.cached += 1
            self._register(seq)
        tokens = self._choose(rows, logits)
        logprobs = self._logprobs(rows, logits, tokens)
        now = time.perf_counter()
        first, later = [], []
        for seq, token, lp in zip(rows, tokens, logprobs):
            (later if seq.last_token_at else first).append(now - (seq.last_token_at or seq.arrived))
            seq.last_token_at = now
            self._append(seq, token, lp)
            if seq.finished:
                self.scheduler.finish(seq)
        self.metrics.tokens(first, later)
        return rows

    def _register(self, seq: Sequence) -> None:
        """Put the blocks ``seq`` filled in the prefix cache: those of its prompt were hashed when it came,
        those of its reply are hashed as they fill (a conversation's next turn re-sends the reply)."""
        if self.hasher is None:
            return
        while seq.registered < seq.cached // BLOCK_SIZE:
            i = seq.registered
            if i == len(seq.block_hashes):
                parent = seq.block_hashes[-1] if i else self.hasher.root(seq.request.cache_salt)
                seq.block_hashes += self.hasher.chain(parent, [seq.token_at(p) for p in range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)])
            self.scheduler.blocks.register(seq.row, i, seq.block_hashes[i])
            seq.registered += 1

    def _choose(self, rows: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row: one argmax for every plain greedy row, one batched pass (``sample``) for the
        rest, on a copy of their logits (the raw ones give the logprobs)."""
        plain = [i for i, s in enumerate(rows) if s.sampler.plain]
        if len(plain) == len(rows):
            return logits.argmax(-1).tolist()
        tokens = logits.argmax(-1).tolist() if plain else [0] * len(rows)
        others = [i for i, s in enumerate(rows) if not s.sampler.plain]
        chosen = sample([rows[i].sampler for i in others], logits[others],
                        [(rows[i].request.input_ids, rows[i].output_ids) for i in others])
        for i, token in zip(others, chosen):
            tokens[i] = token
        return tokens

    @staticmethod
    def _logprobs(rows: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprobs | None]:
        """For the rows that ask: the chosen token's log-probability under the model's own distribution
        (as vLLM reports it: before temperature and penalties) and the ``logprobs`` most likely tokens."""
        asking = [i for i, seq in enumerate(rows) if seq.request.top_logprobs is not None]
        found: list[TokenLogprobs | None] = [None] * len(rows)
        if not asking:
            return found
        top = max(rows[i].request.top_logprobs for i in asking)
        logprobs = logits[asking].float().log_softmax(-1)
        chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in asking], device=logits.device))[:, 0].tolist()
        best = logprobs.topk(top, -1) if top else None
        for j, i in enumerate(asking):
            k = rows[i].request.top_logprobs
            found[i] = TokenLogprobs(chosen[j], best.indices[j, :k].tolist() if k else [],
                                     best.values[j, :k].tolist() if k else [])
        return found

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        request = seq.request
        if token in seq.sampler.ends:  # the end-of-turn token (unless ignore_eos) or a stop token: not in the reply
            seq.finish_reason = FinishReason.STOP
            return
        seq.output_ids.append(token)
        if logprobs is not None:
            seq.token_logprobs.append(logprobs)
        matcher = seq.sampler.matcher
        if matcher is not None and not matcher.consume_token(token):  # its mask let only valid tokens through
            seq.finish_reason, seq.error = FinishReason.ERROR, f"the grammar refused token {token}: {matcher.get_error()}"
        elif matcher is not None and matcher.is_stopped():
            seq.finish_reason = FinishReason.STOP  # the grammar is complete
        elif seq.text.add(seq.output_ids):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_ids) >= request.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
