"""The batched sampler against the definitions it implements, row by row."""

from __future__ import annotations

import pytest
import torch

from llm.request import GenerationRequest
from llm.sampling import BatchSampler, SamplingParams
from llm.sequence import Sequence

CPU = torch.device("cpu")
VOCAB = 64


def sample(params: list[SamplingParams], x: torch.Tensor, histories: list[tuple[list[int], list[int]]],
           ends: frozenset[int] = frozenset()) -> list[int]:
    """Each row's token from one ``BatchSampler`` step, row ``i`` the request of ``params[i]`` with the
    prompt and reply of ``histories[i]``; ``ends`` its end-of-turn tokens."""
    sampler = BatchSampler(len(params), CPU, set(ends))
    seqs = [Sequence(GenerationRequest(list(prompt), 16, p), output_ids=list(reply), row=i + 1)
            for i, (p, (prompt, reply)) in enumerate(zip(params, histories))]
    before = x.clone()
    tokens = sampler.sample(x, seqs).tokens
    assert torch.equal(x, before)  # the logits are the model's still: logprobs are read from them
    return tokens


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_seeded_row_draws_the_same_alone_or_among_any_batch_mates():
    row = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7)
    mates = [SamplingParams(temperature=1.3, seed=1), SamplingParams(), SamplingParams(temperature=0.5, top_k=3)]
    x = logits(4)
    history = [([1, 2], [3])] * 4
    alone = sample([row], x[:1].clone(), history[:1])[0]
    for order in ([0, 1, 2, 3], [1, 0, 3, 2], [3, 2, 1, 0]):
        params = [row if i == 0 else mates[i - 1] for i in order]
        together = sample(params, x[order].clone(), history)
        assert together[order.index(0)] == alone


def test_top_k_and_top_p_keep_only_the_tokens_they_allow():
    x = logits(1)
    ranked = x[0].argsort(descending=True).tolist()
    probs = x[0].softmax(-1)
    nucleus = len([c for c in probs[ranked].cumsum(0).tolist() if c < 0.5]) + 1  # the crossing token kept
    for seed in range(200):
        assert sample([SamplingParams(temperature=1.0, top_k=3, seed=seed)], x.clone(), [([1], [])])[0] in ranked[:3]
        assert sample([SamplingParams(temperature=1.0, top_p=0.5, seed=seed)], x.clone(), [([1], [])])[0] in ranked[:nucleus]
    assert sample([SamplingParams(temperature=1.0, top_k=1, seed=3)], x.clone(), [([1], [])]) == [ranked[0]]


def test_draws_follow_the_softmax_of_the_scaled_logits():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    counts = torch.zeros(VOCAB)
    for seed in range(4000):
        counts[sample([SamplingParams(temperature=0.7, seed=seed)], x.clone(), [([1], [])])[0]] += 1
    expected = (x[0] / 0.7).softmax(-1)[:4]
    assert torch.allclose(counts[:4] / 4000, expected, atol=0.03)


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=1.5),
                                    SamplingParams(frequency_penalty=-0.7), SamplingParams(frequency_penalty=0.4, presence_penalty=0.3)])
def test_penalties_are_the_per_row_definitions(params):
    """Greedy rows with a penalty: the argmax of the logits penalized as transformers (repetition) and OpenAI
    (presence, frequency: the reply only) define it, row by row, whatever the other rows ask."""
    x = logits(3, seed=5)
    histories = [([4, 9, 9], [9, 11, 11, 11]), ([1], []), ([2, 3], [5, 5, 2])]
    chosen = sample([params, SamplingParams(), params], x.clone(), histories)
    for row, (prompt, reply) in enumerate(histories):
        y = x[row].clone()
        p = params if row != 1 else SamplingParams()
        for token in set(prompt + reply) if p.repetition_penalty != 1.0 else ():
            y[token] = y[token] / p.repetition_penalty if y[token] > 0 else y[token] * p.repetition_penalty
        for token in set(reply):
            y[token] -= p.frequency_penalty * reply.count(token) + p.presence_penalty
        assert chosen[row] == int(y.argmax()), row


def nucleus(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p allow, by the definition: sort the whole vocabulary."""
    ordered, order = row.sort(descending=True)
    kept = ordered.clone()
    if top_k:
        kept[top_k:] = float("-inf")
    probs = kept.softmax(-1)
    allowed = (probs.cumsum(-1) - probs < top_p) & (probs > 0)
    return set(order[allowed].tolist())


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 0.95), (20, 0.5), (0, 0.3)])
def test_draws_among_the_candidates_or_the_whole_vocabulary_keep_to_the_definition(monkeypatch, top_k, top_p):
    """With fewer candidates than the vocabulary (8 of 64 here, 1024 in service): a peaked row finds its
    nucleus among them, a flat one does not and takes the full pass; both only ever draw allowed tokens,
    and a seeded row draws the same alone or beside rows of the other kind."""
    monkeypatch.setattr("llm.sampling.CANDIDATES", 8)
    peaked, flat = logits(1, seed=2) * 4, logits(1, seed=3) * 0.05
    for row in (peaked, flat):
        allowed = nucleus(row[0], top_k, top_p)
        for seed in range(100):
            token = sample([SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=seed)], row.clone(),
                           [([1], [])])[0]
            assert token in allowed
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=11)
    alone = [sample([params], row.clone(), [([1], [])])[0] for row in (peaked, flat)]
    together = sample([params, params], torch.cat([peaked, flat]), [([1], [])] * 2)
    assert together == alone


@pytest.mark.parametrize("candidates", [1024, 8])
@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_draws_only_tokens_at_least_min_p_times_as_likely_as_the_best(monkeypatch, candidates, min_p):
    """Among the candidates or (8 of 64, a flat row) past them, as vLLM defines it: after temperature, a token
    is kept when its probability is at least min_p times the most likely one's."""
    monkeypatch.setattr("llm.sampling.CANDIDATES", candidates)
    for row in (logits(1, seed=4) * 3, logits(1, seed=5) * 0.05):
        probs = (row[0] / 0.8).softmax(-1)
        allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
        drawn = {sample([SamplingParams(temperature=0.8, min_p=min_p, seed=s)], row.clone(), [([1], [])])[0]
                 for s in range(150)}
        assert drawn <= allowed
        assert len(drawn) > 1 or len(allowed) == 1  # it still samples among the tokens it keeps


def test_min_p_of_one_is_the_most_likely_token():
    x = logits(3, seed=6)
    params = [SamplingParams(temperature=1.5, min_p=1.0, seed=s) for s in range(3)]
    assert sample(params, x.clone(), [([1], [])] * 3) == x.argmax(-1).tolist()


def test_logit_bias_forces_or_bans_a_token_for_greedy_and_sampled_rows():
    x = logits(2, seed=7)
    best, other = x[0].argmax().item(), x[0].argmin().item()
    force, ban = SamplingParams(logit_bias=((other, 100.0),)), SamplingParams(logit_bias=((best, -100.0),))
    assert sample([force, SamplingParams(temperature=1.0, logit_bias=((other, 100.0),), seed=1)],
                  torch.stack([x[0], x[0]]), [([1], [])] * 2) == [other, other]
    assert sample([ban], x[:1].clone(), [([1], [])]) == [x[0].topk(2).indices[1].item()]


def test_min_tokens_bans_the_ending_tokens_until_the_reply_has_them():
    x = logits(1, seed=8)
    end = x[0].argmax().item()
    held = SamplingParams(min_tokens=2)
    assert sample([held], x.clone(), [([1], [5])], {end}) == [x[0].topk(2).indices[1].item()]  # 1 token of 2: held back
    assert sample([held], x.clone(), [([1], [5, 6])], {end}) == [end]  # reached
    stop_token = SamplingParams(min_tokens=1, stop_token_ids=(end,))
    assert sample([stop_token], x.clone(), [([1], [])]) != [end]


def test_a_rows_settings_are_written_once_and_a_new_request_on_the_row_gets_its_own():
    """The per-row parameter tensors are kept between steps; the row's next request overwrites them."""
    x = logits(1, seed=9)
    sampler = BatchSampler(1, CPU, set())
    hot = Sequence(GenerationRequest([1], 16, SamplingParams(temperature=5.0, seed=1)), row=1)
    draws = [sampler.sample(x, [hot]).tokens[0] for _ in range(20)]
    assert sampler.floats[1, 0] == 5.0 and len(set(draws)) > 1  # the same generator, drawing on
    greedy = Sequence(GenerationRequest([1], 16), row=1)
    assert sampler.sample(x, [greedy]).tokens == [int(x.argmax())] and sampler.floats[1, 0] == 0.0
    sampler.release(greedy)
    assert sampler.sample(x, [hot]).tokens[0] in draws  # back on the row: installed again
