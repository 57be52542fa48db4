"""Token choice for the whole step: one ``BatchSampler`` takes the step's logits and its rows and returns
each row's token and, for the rows that ask, its logprobs. Greedy by default, or seeded sampling with
temperature, top-k, min-p and top-p, after each request's grammar mask, its repetition, presence and
frequency penalties, its logit bias and (until min_tokens) its ending tokens banned; every setting per
request, every pass batched.

As vLLM v1's sampler keeps its rows' parameters in tensors between steps, a request's settings are
written into per-row tensors once, the first time its row samples, and each step gathers the rows it
needs from them instead of building them again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from llm import grammar
from llm.request import SamplingParams
from llm.sequence import Sequence, TokenLogprobs

# The float parameters' columns in ``BatchSampler.floats``.
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)


class Sampled(NamedTuple):
    """One step's choice: a token per row, and per row its logprobs when the request asks (else None)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class _Row:
    """A row's sampling state that no tensor holds: its request, the tokens that end its reply (its
    end-of-turn token unless ``ignore_eos``, and its stop tokens), its grammar and its own generator."""

    seq: Sequence
    ends: frozenset[int]
    plain: bool  # greedy with nothing that changes the logits: the batch's one argmax serves it
    generator: torch.Generator | None


class BatchSampler:
    def __init__(self, rows: int, device: torch.device, eos_ids: set[int]) -> None:
        """``rows``: the engine's most running requests (rows 1..rows; row 0 is the cache's scratch)."""
        self.device, self.eos_ids = device, frozenset(eos_ids)
        self.floats = torch.zeros((rows + 1, 6), dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self._rows: list[_Row | None] = [None] * (rows + 1)

    def ends(self, seq: Sequence) -> frozenset[int]:
        """The tokens that end ``seq``'s reply, not part of it (the update's stop check)."""
        return self._rows[seq.row].ends

    def release(self, seq: Sequence) -> None:
        """``seq`` left its row: its state goes (its generator, its grammar's matcher)."""
        if self._rows[seq.row] is not None and self._rows[seq.row].seq is seq:
            self._rows[seq.row] = None

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """A token for each of ``seqs`` from its row of ``logits`` (float32, left unchanged): one argmax for
        the plain greedy rows, one batched pass for the rest; then the logprobs the rows ask for, from the
        model's own distribution."""
        rows = [self._row(seq) for seq in seqs]
        tokens = logits.argmax(-1)
        others = [i for i, r in enumerate(rows) if not r.plain]
        if others:
            index = torch.tensor(others, device=logits.device)
            tokens[index] = self._choose(logits[index], [rows[i] for i in others])
        chosen = tokens.tolist()
        return Sampled(chosen, _logprobs(seqs, logits, chosen))

    def _row(self, seq: Sequence) -> _Row:
        """The state of ``seq``'s row, written the first time it samples."""
        row = self._rows[seq.row]
        if row is not None and row.seq is seq:
            return row
        request, p = seq.request, seq.request.sampling
        ends = (frozenset() if request.ignore_eos else self.eos_ids) | frozenset(p.stop_token_ids)
        generator = None
        if not p.greedy:
            generator = torch.Generator(self.device)
            if p.seed is None:
                generator.seed()
            else:
                generator.manual_seed(p.seed)
        plain = (p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                 and not p.logit_bias and not p.min_tokens and seq.matcher is None)
        self.floats[seq.row] = torch.tensor([p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                                             p.presence_penalty, p.frequency_penalty], device=self.device)
        self.top_k[seq.row] = p.top_k
        self._rows[seq.row] = row = _Row(seq, ends, plain, generator)
        return row

    def _choose(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """A token per row of ``logits`` (a copy, changed in place): the grammar masks, the penalties, then
        the greedy rows' argmax and the other rows' draws, each a vectorized pass over the rows that need
        it (as nano-vllm's and vLLM's samplers do). A row's draw uses its own generator only (an
        exponential race: the argmax of probabilities over exponential noise, the same distribution as
        multinomial), so a seed gives its row the same tokens whatever its batch-mates."""
        index = torch.tensor([r.seq.row for r in rows], device=logits.device)
        floats, params = self.floats[index], [r.seq.request.sampling for r in rows]
        grammar.mask(logits, [r.seq.matcher for r in rows])
        _penalize(logits, params, floats, [r.seq for r in rows])
        _bias(logits, rows)
        tokens = logits.argmax(-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            at = torch.tensor(drawn, device=logits.device)
            chosen = floats[at]
            scaled = logits[at] / chosen[:, TEMPERATURE, None]
            tokens[at] = _draw(scaled, self.top_k[index[at]][:, None], chosen[:, TOP_P, None], chosen[:, MIN_P, None],
                               [rows[i].generator for i in drawn])
        return tokens


def _logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprobs | None]:
    """For the rows that ask: the chosen token's log-probability under the model's own distribution
    (as vLLM reports it: before temperature and penalties) and the ``top_logprobs`` most likely tokens."""
    asking = [i for i, seq in enumerate(seqs) if seq.request.top_logprobs is not None]
    found: list[TokenLogprobs | None] = [None] * len(seqs)
    if asking:
        chosen = torch.tensor([tokens[i] for i in asking], device=logits.device)
        ks = [seqs[i].request.top_logprobs for i in asking]
        for i, logprobs in zip(asking, token_logprobs(logits[asking], chosen, ks)):
            found[i] = logprobs
    return found


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Row ``i``: ``tokens[i]``'s log-probability under ``logits[i]`` and the ``ks[i]`` most likely tokens
    there, most likely first; one log-softmax and one top-k for the rows together, for generated tokens
    (a step's rows) and prompt tokens (a prompt's positions) alike."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    top = max(ks, default=0)
    best = logprobs.topk(top, -1) if top else None
    return [TokenLogprobs(logprob, best.indices[i, :k].tolist() if k else [], best.values[i, :k].tolist() if k else [])
            for i, (logprob, k) in enumerate(zip(chosen, ks))]


# A sampled row draws among its most likely tokens first: exact whenever they hold its top-k, or the
# probability its top-p asks (almost always), at a fraction of the cost of sorting the whole vocabulary
# (3 ms against 25 ms for 16 rows of 49,152 on 2 cores, measured); the other rows take the full pass.
CANDIDATES = 1024


def _race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Each row's draw from ``probs`` (unnormalized, zeros excluded), by its own generator."""
    noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
    return (probs / noise.clamp_min_(1e-20)).argmax(-1)


def _draw(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, m: torch.Tensor,
          generators: list[torch.Generator]) -> torch.Tensor:
    """A token per row of temperature-scaled logits, from the tokens its top-k ``k`` (0: all) and its min-p
    ``m`` (those at least m times as likely as the most likely) keep, and then its top-p ``p`` (the
    smallest set whose probability reaches it, the crossing token kept) allows; ``k``, ``p`` and ``m``
    are ``[rows, 1]`` columns."""
    vocabulary, device = scaled.shape[1], scaled.device
    width = min(CANDIDATES, vocabulary)
    values, order = scaled.topk(width, -1)  # most likely first
    k = torch.where((k > 0) & (k < vocabulary), k, vocabulary)
    floor = values[:, :1] + m.log()  # min_p 0: -inf, no floor
    # The tokens kept lie among the candidates (the top-k does, or the min-p floor falls among them): their
    # distribution is the candidates', renormalized.
    within = (k <= width) | (values[:, -1:] < floor)
    drop = (torch.arange(width, device=device)[None] >= k) | (values < floor)
    probs = torch.where(within, values.masked_fill(drop, float("-inf")).softmax(-1),
                        (values - scaled.logsumexp(-1, keepdim=True)).exp())
    reach = probs.cumsum(-1)
    drop |= (p < 1.0) & (reach - probs >= p)
    exact = (within | ((p < 1.0) & (reach[:, -1:] >= p) & (m == 0.0)))[:, 0].tolist()
    tokens = torch.empty(len(generators), dtype=torch.long, device=device)
    near = [i for i, e in enumerate(exact) if e]
    if near:
        picked = _race(probs[near].masked_fill(drop[near], 0.0), [generators[i] for i in near])
        tokens[near] = order[near].gather(1, picked[:, None])[:, 0]
    far = [i for i, e in enumerate(exact) if not e]
    if far:
        full = _filter(scaled[far], k[far], p[far], m[far])
        tokens[far] = _race(full.softmax(-1), [generators[i] for i in far])
    return tokens


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids of several rows as one ``[rows, longest]`` tensor (padded with the row's first id, harmless to
    a set) and which entries are real."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], device=device)
    real = torch.arange(width, device=device)[None] < torch.tensor([len(r) for r in rows], device=device)[:, None]
    return ids, real


def _penalize(logits: torch.Tensor, params: list[SamplingParams], floats: torch.Tensor, seqs: list[Sequence]) -> None:
    """The repetition penalty (as transformers' RepetitionPenaltyLogitsProcessor: positive logits of tokens
    already in the prompt or reply shrink, negative ones grow), then OpenAI's presence and frequency
    penalties on the reply's tokens, each over the rows that ask for it; ``floats`` holds the rows'
    parameters (``BatchSampler.floats``)."""
    device = logits.device
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeat:
        ids, _ = _padded([seqs[i].request.input_ids + seqs[i].output_ids for i in repeat], device)
        seen = torch.zeros(len(repeat), logits.shape[1], dtype=torch.bool, device=device).scatter_(1, ids, True)
        index = torch.tensor(repeat, device=device)
        penalty, x = floats[index, REPETITION, None], logits[index]
        logits[index] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    counted = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and seqs[i].output_ids]
    if counted:
        ids, real = _padded([seqs[i].output_ids for i in counted], device)
        counts = torch.zeros(len(counted), logits.shape[1], dtype=logits.dtype, device=device)
        counts.scatter_add_(1, ids, real.to(logits.dtype))
        index = torch.tensor(counted, device=device)
        logits[index] -= (floats[index, FREQUENCY, None] * counts
                          + floats[index, PRESENCE, None] * (counts > 0).to(logits.dtype))


def _bias(logits: torch.Tensor, rows: list[_Row]) -> None:
    """Each row's logit_bias added to its tokens' logits, and its ending tokens banned while its reply is
    shorter than min_tokens: one scatter over every row's entries."""
    at, ids, values = [], [], []
    for i, row in enumerate(rows):
        p = row.seq.request.sampling
        for token, bias in p.logit_bias:
            at.append(i), ids.append(token), values.append(bias)
        if len(row.seq.output_ids) < p.min_tokens and row.seq.matcher is None:  # a grammar decides when it may end
            for token in row.ends:
                at.append(i), ids.append(token), values.append(float("-inf"))
    if at:
        index = (torch.tensor(at, device=logits.device), torch.tensor(ids, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def _filter(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token outside each row's top-k ``k`` and below its min-p floor, then outside
    the smallest set whose probability reaches its top-p ``p`` (the token that crosses it kept), set to
    -inf (``[rows, 1]`` columns, ``k`` already the vocabulary where it keeps all)."""
    vocabulary = logits.shape[1]
    logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + m.log(), float("-inf"))
    if not bool(((k < vocabulary) | (p < 1.0)).any()):
        return logits
    ordered, order = logits.sort(-1, descending=True)
    drop = torch.arange(vocabulary, device=logits.device)[None] >= k
    probs = ordered.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (p < 1.0) & (probs.cumsum(-1) - probs >= p)
    return logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
