"""The in-flight batching engine, sampling and validation, driven in-process with a tiny random Llama.

The engine runs eagerly here (compile=False), except in the tests of the compiled path: its tokens, and
that nothing compiles once it is built.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llm.reference import NAME, StaticGenerator, use_grouped_attention
from conftest import Letters
from contract.errors import InvalidInput
from contract.schema import FinishReason
from contract.stops import partial_stop_length, visible_text
from llm import LLM, LLMConfig
from llm.compiles import COMPILATIONS
from llm.kv import BLOCK_SIZE, BlockHasher, blocks_for
from llm.metrics import EngineMetrics
from llm.scheduler import Overloaded
from llm.sequence import Sequence
from llm.service import EngineLoop
from llm.shapes import Shape, Shapes

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]


BUDGET = 208  # KV slots: 13 blocks


def random_llama(seed: int = 0, **sizes: int) -> LlamaForCausalLM:
    """A tiny Llama of random weights (``seed``), without an end token; ``sizes`` override its config's."""
    torch.manual_seed(seed)
    config = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(LlamaConfig(**config | sizes, eos_token_id=None, pad_token_id=0))


@pytest.fixture
def model() -> LlamaForCausalLM:
    model = random_llama()
    model.generation_config.eos_token_id = None
    return model


def tiny(model, **config) -> LLM:
    """An engine on ``model`` in its own dtype: a float32 one says so, as ``dtype: auto`` would keep float32's
    activations but store the linear layers in bfloat16 on a CPU without native bfloat16 (llm.bf16_storage),
    and these tests compare with Hugging Face's float32 replies exactly."""
    own = "float32" if model.dtype == torch.float32 else "auto"
    settings = {"default_max_tokens": 4, "max_tokens_limit": 16, "kv_cache_tokens": BUDGET, "compile": False,
                "dtype": own} | config
    return LLM(LLMConfig("unused", **settings), torch.device("cpu"), model, Letters())


@pytest.fixture
def llm(model) -> LLM:
    return tiny(model)


def one_by_one(model, llm: LLM, requests) -> list[list[int]]:
    """Each request's greedy reply from Hugging Face ``generate``, alone."""
    reference = StaticGenerator(model, llm)
    return [reference.generate([r])[0] for r in requests]


def run(engine, seqs: list[Sequence], join_after: list[int] | None = None) -> list[Sequence]:
    """Add ``seqs[i]`` after ``join_after[i]`` steps (all at once by default) and step until done."""
    join_after = join_after or [0] * len(seqs)
    steps = 0
    while engine.has_work or any(s.finish_reason is None for s in seqs):
        for seq, at in zip(seqs, join_after):
            if at == steps:
                engine.add(seq)
        engine.step()
        steps += 1
        assert steps < 500
    return seqs


def test_rows_joining_mid_generation_match_one_by_one_greedy(model, llm):
    requests = [llm.validate(ids, 12) for ids in PROMPTS]
    seqs = run(llm.engine(), [Sequence(r) for r in requests], join_after=[0, 3, 7])
    assert [s.output_ids for s in seqs] == one_by_one(model, llm, requests)


def test_rows_of_different_lengths_joining_and_leaving_share_the_paged_cache_exactly(model):
    """Prompts of 1 to 40 tokens, across block boundaries, replies of 1 to 16, joining every few steps:
    each equals its reply alone, and every block is free again at the end."""
    llm = tiny(model, max_tokens_limit=16, max_batched_tokens=24, max_running_requests=6)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (int(n),), generator=rng).tolist() for n in torch.randint(1, 41, (12,), generator=rng)]
    requests = [llm.validate(p, int(n), ignore_eos=True) for p, n in zip(prompts, torch.randint(1, 17, (12,), generator=rng))]
    engine = llm.engine()
    seqs = run(engine, [Sequence(r) for r in requests], join_after=[0, 0, 1, 2, 3, 5, 8, 13, 14, 15, 21, 30])
    assert [s.output_ids for s in seqs] == one_by_one(model, llm, requests)
    assert engine.kv_tokens == 0 and engine.running == []


def test_the_kv_budget_counts_whole_blocks_of_each_request_exactly(llm):
    engine = llm.engine()
    requests = [llm.validate(PROMPTS[1], 9), llm.validate(PROMPTS[0], 14), llm.validate(PROMPTS[2], 16)]  # 16, 17, 17
    for r in requests:
        engine.add(Sequence(r))
    engine.step()
    assert engine.kv_tokens == sum(blocks_for(r.reserved_tokens) for r in requests) * BLOCK_SIZE == 80


def test_a_long_prompt_is_prefilled_in_chunks_while_running_rows_keep_decoding(model, monkeypatch):
    llm = tiny(model, max_batched_tokens=8, max_running_requests=2)
    engine = llm.engine()
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        steps.append(schedule())
        return steps[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    short = Sequence(llm.validate(PROMPTS[0], 16, ignore_eos=True))
    engine.add(short)
    engine.step()
    long = Sequence(llm.validate(list(range(1, 41)), 4, ignore_eos=True))
    engine.add(long)
    while not long.output_ids:
        before = len(short.output_ids)
        engine.step()
        assert len(short.output_ids) == before + 1  # the running row got its token in every step
    assert [count for step in steps for seq, count in step.prefill if seq is long] == [7, 7, 7, 7, 7, 5]
    assert max(step.tokens for step in steps) == 8  # max_batched_tokens
    run(engine, [])
    assert [short.output_ids, long.output_ids] == one_by_one(model, llm, [short.request, long.request])


def test_the_compiled_forward_pass_gives_the_eager_tokens(model):
    requests = [tiny(model).validate(ids, 12) for ids in PROMPTS]
    replies = {}
    for compiled in (False, True):
        llm = tiny(model, compile=compiled)
        replies[compiled] = [s.output_ids for s in run(llm.engine(), [Sequence(r) for r in requests], join_after=[0, 2, 5])]
    assert replies[True] == replies[False] == one_by_one(model, llm, requests)


def test_each_compiled_decoder_of_a_process_runs_graphs_of_its_own(model):
    """The guards on a decoder's own modules and weights are not checked each step (llm.runner): two
    decoders of other shapes in one process (a server loads one, tests many) must still never share a
    graph, or the second would run the first's layers."""
    deeper = random_llama(1, hidden_size=64, intermediate_size=96, num_hidden_layers=3)
    for each in (model, deeper):
        llm = tiny(each, compile=True)
        requests = [llm.validate(ids, 12) for ids in PROMPTS]
        assert [s.output_ids for s in run(llm.engine(), [Sequence(r) for r in requests])] == one_by_one(each, llm, requests)


def sweep(llm: LLM, engine) -> tuple[list[Sequence], list]:
    """Traffic that reaches every limit of ``llm``'s config: 1 to max_running_requests rows joining and
    leaving, prompts from 1 token to the longest allowed, contexts up to the request limit, greedy and
    sampled rows, logprobs on and off. Returns the sequences and each step's shape as run."""
    c, room = llm.config, llm.room
    rng = torch.Generator().manual_seed(3)
    lengths = [1, 2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, c.max_batched_tokens + 3, room // 2,
               room - c.max_tokens_limit, room - 1]
    seqs = []
    for i in range(48):
        prompt = torch.randint(1, 256, (lengths[i % len(lengths)],), generator=rng).tolist()
        sampled, logprobs = i % 2 == 1, i % 4 < 2
        seqs.append(Sequence(llm.validate(
            prompt, min(c.max_tokens_limit, room - len(prompt)) if i % 3 else 1, ignore_eos=True,
            temperature=0.8 if sampled else None, top_p=0.9 if sampled else None, seed=i if sampled else None,
            logprobs=logprobs, top_logprobs=2 if logprobs else None,
        )))
    burst = [Sequence(llm.validate([7] * (i + 1), c.max_tokens_limit - i, ignore_eos=True)) for i in range(c.max_running_requests)]
    pending, shapes = burst + seqs, []
    while pending or engine.has_work:
        for _ in range(len(burst) if pending and pending[0] is burst[0] else int(torch.randint(0, 4, (1,), generator=rng))):
            if pending:
                engine.add(pending.pop(0))
        engine.step()
        shapes.append(engine.runner.last_shape)
    assert all(s.finish_reason == "length" for s in burst + seqs)
    return seqs, shapes


@pytest.fixture(scope="module")
def sweep_model() -> LlamaForCausalLM:
    return random_llama(max_position_embeddings=256)


SWEEP_CONFIG = {"kv_cache_tokens": 2048, "max_tokens_limit": 64, "max_running_requests": 8, "max_batched_tokens": 32}


@pytest.mark.parametrize("pad", [False, True], ids=["cpu-rules", "gpu-padding-rules"])
def test_nothing_compiles_after_the_engine_is_built(sweep_model, pad):
    """Issue 20: a request never waits on the compiler. The engine compiles at load; a sweep of traffic
    that reaches every limit then compiles nothing (dynamo's own count), and its greedy replies are the
    eager engine's."""
    llm = tiny(sweep_model, compile=True, **SWEEP_CONFIG)
    engine = llm.engine(pad=pad)
    built = COMPILATIONS.count
    seqs, shapes = sweep(llm, engine)
    assert COMPILATIONS.count == built, f"{COMPILATIONS.count - built} compilations under traffic"
    eager = tiny(sweep_model, **SWEEP_CONFIG)
    expected, _ = sweep(eager, eager.engine())
    greedy = [i for i, s in enumerate(seqs) if s.request.sampling.greedy]
    assert [seqs[i].output_ids for i in greedy] == [expected[i].output_ids for i in greedy]


def test_with_the_gpu_padding_rules_every_step_shape_was_run_at_load(sweep_model):
    """Issue 20, the CPU proof of the GPU path: with the padding rules a GPU uses, every shape a sweep of
    traffic produces (rows, context columns, prompt-token bucket) is one the engine ran, and on CUDA
    captured, while it loaded."""
    llm = tiny(sweep_model, **SWEEP_CONFIG)
    engine = llm.engine(pad=True)
    warmed = set(engine.runner.shapes.warm_up())  # eager: the same plan a compiled engine runs at load
    _, shapes = sweep(llm, engine)
    assert set(shapes) <= warmed, f"never run at load: {sorted(set(shapes) - warmed, key=str)}"
    decode = [s for s in shapes if s.kind == "decode"]
    # The sweep reached every limit: every row bucket, the longest context, the largest prompt bucket.
    assert {s.tokens for s in decode} == set(engine.runner.shapes.rows)
    assert max(s.columns for s in decode) == llm.room
    assert max(s.tokens for s in shapes if s.kind == "mixed") == llm.config.max_batched_tokens


def test_the_buckets_bound_the_shapes_and_cover_every_size():
    shapes = Shapes.plan(True, max_rows=64, max_columns=8192, max_tokens=256)
    assert shapes.rows == (2, 4, 8, 16, 32, 64) and shapes.columns == (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert shapes.tokens == (16, 32, 64, 128, 256)
    assert len(shapes.warm_up()) == 6 * 8 + 5
    assert {shapes.decode(r, c) for r in range(1, 65) for c in range(1, 8193, 7)} <= set(shapes.warm_up())
    assert {shapes.mixed(d, t - d, min(t, 64)) for t in range(1, 257) for d in range(min(t, 64))} <= set(shapes.warm_up())
    odd = Shapes.plan(True, max_rows=48, max_columns=100, max_tokens=200)
    assert (odd.rows[-1], odd.columns, odd.tokens[-1]) == (48, (64, 100), 200)
    exact = Shapes.plan(False, max_rows=64, max_columns=8192, max_tokens=256)
    assert exact.decode(3, 77).tokens == 3 and exact.decode(3, 77).columns == 77 and len(exact.warm_up()) == 2
    assert exact.mixed(0, 1, 1).tokens == 4 and exact.mixed(5, 20, 6) == Shape("mixed", 25, 0, 6)


def test_each_row_keeps_its_own_max_tokens_and_leaves_at_once(llm):
    engine = llm.engine()
    seqs = run(engine, [Sequence(llm.validate(ids, n)) for ids, n in zip(PROMPTS, [1, 8, 3])])
    assert [len(s.output_ids) for s in seqs] == [1, 8, 3] and {s.finish_reason for s in seqs} == {"length"}
    assert engine.running == [] and engine.kv_tokens == 0


def test_a_seeded_row_samples_the_same_whatever_its_batch_mates(llm):
    sampled = llm.validate(PROMPTS[0], 12, temperature=1.0, top_k=50, top_p=0.9, seed=5)
    alone = run(llm.engine(), [Sequence(sampled)])[0].output_ids
    mates = [llm.validate(PROMPTS[1], 16, temperature=0.7, seed=9), llm.validate(PROMPTS[2], 5)]
    crowded = run(llm.engine(), [Sequence(mates[0]), Sequence(sampled), Sequence(mates[1])], join_after=[0, 2, 4])
    assert crowded[1].output_ids == alone
    other_seed = run(llm.engine(), [Sequence(llm.validate(PROMPTS[0], 12, temperature=1.0, top_k=50, top_p=0.9, seed=6))])
    assert other_seed[0].output_ids != alone


def test_repetition_penalty_changes_greedy_choices(llm):
    plain = run(llm.engine(), [Sequence(llm.validate(PROMPTS[0], 16))])[0].output_ids
    penalised = run(llm.engine(), [Sequence(llm.validate(PROMPTS[0], 16, repetition_penalty=2.0))])[0].output_ids
    assert plain != penalised


def test_a_stop_string_ends_the_row_on_text(llm):
    reply = run(llm.engine(), [Sequence(llm.validate(PROMPTS[1], 16))])[0].output_ids
    text = Letters().decode(reply)
    stop = text[4:6]  # spans two tokens: matched on text, not on a single token
    seq = run(llm.engine(), [Sequence(llm.validate(PROMPTS[1], 16, stop=[stop.encode()]))])[0]
    assert seq.finish_reason == "stop" and Letters().decode(seq.output_ids).find(stop) == text.find(stop)


def test_eos_ends_the_reply_unless_ignored(llm):
    reply = run(llm.engine(), [Sequence(llm.validate(PROMPTS[0], 8))])[0].output_ids
    llm.eos_ids = {reply[2]}
    stopped, forced = run(llm.engine(), [Sequence(llm.validate(PROMPTS[0], 8)), Sequence(llm.validate(PROMPTS[0], 8, ignore_eos=True))])
    assert stopped.output_ids == reply[: reply.index(reply[2])] and stopped.finish_reason == "stop"
    assert forced.output_ids == reply and forced.finish_reason == "length"


def test_the_kv_budget_queues_requests_first_come_first_served(llm):
    engine = llm.engine()  # budget 13 blocks; each request reserves 3 + 16 = 19 slots: 2 blocks
    seqs = [Sequence(llm.validate(PROMPTS[0], 16, ignore_eos=True)) for _ in range(14)]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    assert engine.running == seqs[:6] and engine.waiting == seqs[6:]
    run(engine, [])
    assert all(s.finish_reason == "length" for s in seqs)


def test_past_max_queued_requests_a_request_is_refused_at_once(llm):
    llm.config = replace(llm.config, max_queued_requests=2)
    engine = llm.engine()  # nothing admitted before a step, so every add waits
    for _ in range(2):
        engine.add(Sequence(llm.validate(PROMPTS[0], 16)))
    with pytest.raises(Overloaded, match=r"^2 requests are already waiting .*max_queued_requests=2"):
        engine.add(Sequence(llm.validate(PROMPTS[0], 16)))
    run(engine, [])
    assert len(engine.waiting) == 0


def test_a_request_waiting_past_max_queue_seconds_leaves_with_an_error(llm):
    llm.config = replace(llm.config, max_queue_seconds=5.0)
    engine = llm.engine()
    seqs = [Sequence(llm.validate(PROMPTS[0], 16, ignore_eos=True)) for _ in range(12)]  # 6 fit the budget
    for seq in seqs:
        engine.add(seq)
    engine.step()
    late = seqs[-1]
    late.arrived -= 10  # as if it had waited 10 s for room
    changed = engine.step()
    assert late in changed and late.finish_reason == "overloaded" and late not in engine.waiting
    assert "waited 10 s for room in the KV budget (max_queue_seconds=5)" in late.error
    run(engine, [])
    assert [s.finish_reason for s in seqs].count("length") == 11


def test_a_cancelled_row_leaves_at_the_next_step(llm):
    engine = llm.engine()
    long, short = Sequence(llm.validate(PROMPTS[1], 16)), Sequence(llm.validate(PROMPTS[0], 16))
    engine.add(long), engine.add(short)
    engine.step(), engine.step()
    engine.cancel(long)
    changed = engine.step()
    assert long in changed and long.finish_reason == "cancelled" and engine.running == [short]


@pytest.mark.parametrize(
    "ids, kwargs, message",
    [
        ([1], {"max_tokens": 0}, r"max_tokens must be in \[1, 16\], got 0"),
        ([1], {"max_tokens": 17}, r"max_tokens must be in \[1, 16\], got 17"),
        ([], {}, "input_ids must not be empty"),
        ([1, 256], {}, r"token id 256, outside the model vocabulary \[0, 256\)"),
        ([1] * 60, {"max_tokens": 8}, "prompt is 60 tokens; with max_tokens=8 it exceeds the 64 tokens"),
        ([1], {"temperature": float("nan")}, "temperature must be a finite number"),
        ([1], {"temperature": -1.0}, r"temperature must be in \[0.0, 2.0\]"),
        ([1], {"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\]"),
        ([1], {"top_k": 257}, r"top_k must be in \[0, 256\]"),
        ([1], {"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ([1], {"seed": -4}, r"seed must be in \[0, "),
        ([1], {"stop": [b"a"] * 9}, r"stop holds 9 strings; the limit is 8"),
        ([1], {"stop": [b"\xff"]}, r"stop\[0\] is not valid UTF-8"),
        ([1], {"tokenizer_fingerprint": "x"}, "does not match the llm model's vocabulary"),
        ([1], {"prompt_logprobs": 6}, r"prompt_logprobs must be in \[0, 5\], got 6"),
        ([1], {"cache_salt": b""}, "cache_salt must be 1 to 256 bytes of UTF-8, got 0"),
        ([1], {"cache_salt": "é" * 129}, "cache_salt must be 1 to 256 bytes of UTF-8, got 258"),
        ([1], {"cache_salt": b"\xff"}, "cache_salt is not valid UTF-8"),
    ],
)
def test_invalid_requests_name_the_field_and_limit(llm, ids, kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        llm.validate(ids, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float8"}, "parameter 'dtype'"),
        ({"default_max_tokens": 600}, "parameter 'default_max_tokens'"),
        ({"max_context_tokens": -1}, "parameter 'max_context_tokens'"),
        ({"kv_cache_tokens": 0}, "parameter 'kv_cache_tokens'"),
        ({"kv_cache_tokens": 1000}, r"parameter 'kv_cache_tokens' must be a multiple of 16"),
        ({"max_batched_tokens": 64}, r"parameter 'max_batched_tokens' must exceed max_running_requests=64"),
        ({"max_queued_requests": 0}, "parameter 'max_queued_requests'"),
        ({"stream_interval": 0}, "parameter 'stream_interval' must be >= 1, got 0"),
        ({"max_queue_seconds": 0.0}, "parameter 'max_queue_seconds'"),
    ],
)
def test_bad_llm_config_fails_the_load(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig("m", **kwargs)


def test_visible_text_holds_back_what_may_become_a_stop_string():
    assert partial_stop_length("hello wor", ("world",)) == 3
    assert visible_text("hello wor", ("world",), final=False) == "hello "
    assert visible_text("hello wor", ("world",), final=True) == "hello wor"
    assert visible_text("hello world!", ("world",), final=False) == "hello "
    assert visible_text("caf\ufffd", (), final=False) == "caf"


def test_the_baselines_grouped_attention_matches_sdpa(model, llm):
    """llm/reference.py: the reference generator's attention kernel changes speed, not numbers."""
    use_grouped_attention(model, torch.device("cpu"))
    assert model.config._attn_implementation == NAME
    ids = torch.tensor([[0, 0, 0, 0, 5, 6, 7], PROMPTS[1]])
    mask = (torch.arange(7) >= torch.tensor([[4], [0]])).long()
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        reference = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, reference)


def test_prompt_logprobs_are_the_models_own_and_meet_the_generated_tokens(model, llm):
    """Each prompt token's log-probability given the ones before it, as Hugging Face's forward pass gives it;
    and a generated token, sent again as part of a prompt, gets the logprob it was generated with."""
    prompt = [5, 17, 42, 9, 100, 3]
    seq = run(llm.engine(), [Sequence(llm.validate(prompt, 1, logprobs=True, prompt_logprobs=3))])[0]
    expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert len(seq.prompt_token_logprobs) == len(prompt) - 1
    for position, lp in enumerate(seq.prompt_token_logprobs, start=1):
        assert lp.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=1e-4)
        assert lp.top_ids == expected[position - 1].topk(3).indices.tolist()
    again = run(llm.engine(), [Sequence(llm.validate(prompt + seq.output_ids, 1, prompt_logprobs=0))])[0]
    assert again.prompt_token_logprobs[-1].logprob == pytest.approx(seq.token_logprobs[0].logprob, abs=1e-4)
    assert again.prompt_token_logprobs[-1].top_ids == []
    plain = run(llm.engine(), [Sequence(llm.validate(prompt, 1))])[0]
    assert plain.prompt_token_logprobs == [] and plain.output_ids == seq.output_ids  # nothing asked, nothing computed


# The engine's port (llm/service.py): what Triton's glue and the static baseline both talk to.


def port_run(llm: LLM, submit, requests: int, slow: float = 0.0, stream_interval: int = 1, deliveries=None,
             on_update=lambda update: None) -> dict:
    """An EngineLoop on ``llm``: ``submit(loop)`` submits ``requests`` requests; their updates, by key,
    once each had its final one. Each step takes ``slow`` seconds more, so a test can act mid-request;
    ``on_update`` sees each update as it is given."""
    updates, ended = {}, threading.Semaphore(0)
    given = on_update

    def build():
        engine = llm.engine()
        run = engine.runner.run
        engine.runner.run = lambda step: (time.sleep(slow), run(step))[1]
        return engine

    def on_update(update):
        updates.setdefault(update.key, []).append(update)
        given(update)
        if update.finish_reason is not None:
            ended.release()

    loop = EngineLoop(build, on_update, stream_interval=stream_interval, deliveries=deliveries)
    try:
        submit(loop)
        assert all(ended.acquire(timeout=60) for _ in range(requests))
    finally:
        loop.stop()
    return updates


def test_the_port_streams_a_request_in_order_and_ends_it_once(llm):
    request = llm.validate(PROMPTS[1], 12, ignore_eos=True, logprobs=True)
    updates = port_run(llm, lambda loop: loop.submit(request, "a", every_token=True), 1)["a"]
    assert updates[0].first and not any(u.first for u in updates[1:])
    assert [u.finish_reason for u in updates] == [None] * (len(updates) - 1) + [FinishReason.LENGTH]
    assert [i for u in updates for i in u.ids[u.sent_tokens:]] == run(llm.engine(), [Sequence(request)])[0].output_ids
    assert all(len(u.logprobs) == len(u.ids) for u in updates) and updates[-1].completion_tokens == 12


@pytest.mark.parametrize("interval", [2, 5])
def test_the_port_streams_interval_tokens_at_a_time_after_the_first(llm, interval):
    """vLLM's stream interval: the first token at once, then an update per ``interval`` new tokens, the
    rest in the final one; a request that asked for its end only is not affected."""
    request = llm.validate(PROMPTS[1], 16, ignore_eos=True, logprobs=True)

    def submit(loop):
        loop.submit(request, "streamed", every_token=True)
        loop.submit(request, "whole")

    updates = port_run(llm, submit, 2, slow=0.005, stream_interval=interval)
    streamed = updates["streamed"]
    new = [u.completion_tokens - before for u, before in zip(streamed, [0] + [u.completion_tokens for u in streamed])]
    assert streamed[0].first and new[0] >= 1 and all(n >= interval for n in new[1:-1]), new
    assert len(streamed) <= 2 + (16 - 1) // interval and streamed[-1].completion_tokens == 16
    assert [i for u in streamed for i in u.ids[u.sent_tokens:]] == run(llm.engine(), [Sequence(request)])[0].output_ids
    assert all(len(u.logprobs) == len(u.ids) for u in streamed)
    assert len(updates["whole"]) == 1


class LaggingDeliveries:
    """A transport that takes ``lag`` seconds to deliver each update and says so, as postprocess does
    through ``ipc/delivery.py``."""

    def __init__(self, lag: float) -> None:
        self.lag = lag
        self.given: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.count = self.seen = 0
        self.on_the_way: dict[str, list[int]] = {}  # per key, at each update after the first: tokens not yet delivered

    def give(self, update) -> None:
        key = update.key
        if key in self.given:
            self.on_the_way.setdefault(key, []).append(self.given[key] - self.done.get(key, 0))
        self.given[key] = update.completion_tokens
        threading.Timer(self.lag, self._deliver, (key, update.completion_tokens)).start()

    def _deliver(self, key: str, tokens: int) -> None:
        self.done[key] = max(self.done.get(key, 0), tokens)
        self.count += 1

    def changed(self) -> bool:
        changed, self.seen = self.count != self.seen, self.count
        return changed

    def delivered(self, key: str) -> int | None:
        return self.done.get(key)


def test_the_port_sends_new_tokens_once_the_previous_update_arrived_and_in_order(llm):
    """Coalescing (issue 45): a streamed request's tokens wait while its previous update is on its way and
    join the next, so updates carry several tokens, never overtake one another and add up to the reply;
    the first goes at once, and a request that does not ask (llm called alone) gets every token as it comes."""
    request = llm.validate(PROMPTS[1], 16, ignore_eos=True, logprobs=True)
    deliveries = LaggingDeliveries(lag=0.1)

    def submit(loop):
        loop.submit(request, "coalesced", every_token=True, coalesce=True)
        loop.submit(request, "direct", every_token=True)

    updates = port_run(llm, submit, 2, slow=0.005, deliveries=deliveries, on_update=deliveries.give)
    expected = run(llm.engine(), [Sequence(request)])[0].output_ids
    for key in ("coalesced", "direct"):
        assert [i for u in updates[key] for i in u.ids[u.sent_tokens:]] == expected, key
        assert all(len(u.logprobs) == len(u.ids) for u in updates[key])
        assert updates[key][0].first and updates[key][0].completion_tokens == 1 and updates[key][-1].completion_tokens == 16
    # After the first, no update was given while another was on its way.
    assert set(deliveries.on_the_way["coalesced"]) == {0}, deliveries.on_the_way
    assert len(updates["coalesced"]) < 16 // 2  # a 100 ms trip against steps of 5 ms and more: several tokens an update
    assert len(updates["direct"]) > len(updates["coalesced"])  # its updates never wait


def test_the_port_gives_a_final_only_request_one_update_and_cancels_by_key(llm):
    def submit(loop):
        loop.submit(llm.validate(PROMPTS[0], 16, ignore_eos=True), "whole")
        loop.submit(llm.validate(PROMPTS[2], 16, ignore_eos=True), "gone", every_token=True)
        loop.cancel("gone")
        loop.cancel("no such key")  # already answered, or never submitted: nothing happens

    updates = port_run(llm, submit, 2, slow=0.01)
    [whole] = updates["whole"]
    assert whole.finish_reason is FinishReason.LENGTH and len(whole.ids) == whole.completion_tokens == 16
    assert updates["gone"][-1].finish_reason is FinishReason.CANCELLED and updates["gone"][-1].completion_tokens < 16


# Prefix caching (llm/kv.py): blocks of an earlier request's prompt and reply, reused.

def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def replies(llm: LLM, engine, rounds: list[list[tuple[list[int], int]]], **fields) -> list[list[Sequence]]:
    """Each round's (prompt, max_tokens) requests, added at once, run to the end before the next round."""
    return [run(engine, [Sequence(llm.validate(ids, n, ignore_eos=True, **fields)) for ids, n in requests])
            for requests in rounds]


A = random_ids(2, 40)
SHARING = {  # the second prompt, and the prompt tokens the cache saves it
    "nothing": (random_ids(3, 40), 0),
    "part of a block": (A[:10] + random_ids(3, 30), 0),
    "a block and a part": (A[:20] + random_ids(3, 20), 16),
    "exactly two blocks": (A[:32] + random_ids(3, 8), 32),
    "all its tokens": (A, 32),  # never the last token: its logits are needed
    "all, two whole blocks": (A[:32], 16),
}


@pytest.mark.parametrize("case", SHARING)
def test_replies_with_the_prefix_cache_are_token_for_token_those_without(model, case):
    prompt, saved = SHARING[case]
    rounds = [[(A, 12)], [(prompt, 8)]]
    cached = tiny(model, max_batched_tokens=12, max_running_requests=4)  # chunks that start inside blocks
    plain = tiny(model, max_batched_tokens=12, max_running_requests=4, prefix_caching=False)
    with_cache, without = replies(cached, cached.engine(), rounds), replies(plain, plain.engine(), rounds)
    assert [[s.output_ids for s in r] for r in with_cache] == [[s.output_ids for s in r] for r in without]
    assert [r[0].cached_tokens for r in with_cache] == [0, saved]
    assert [r[0].cached_tokens for r in without] == [0, 0]


def test_a_conversations_next_turn_finds_the_reply_it_resends(model):
    """A's reply (12 tokens) filled blocks too: the next turn, A + reply + a new question, finds them."""
    cached, plain = tiny(model), tiny(model, prefix_caching=False)
    engine = cached.engine()
    first = replies(cached, engine, [[(A, 12)]])[0][0]
    turn = A + first.output_ids + random_ids(4, 4)  # 56 tokens; keys were written for the first 51
    second = replies(cached, engine, [[(turn, 8)]])[0][0]
    assert second.cached_tokens == 48
    assert second.output_ids == replies(plain, plain.engine(), [[(turn, 8)]])[0][0].output_ids


def test_rows_share_cached_blocks_while_other_cached_blocks_are_evicted(model):
    """13 blocks: P and Q leave 2 cached blocks each; two rows then share P's while two fresh prompts
    need Q's blocks, which are evicted, the least recently freed first. Every reply is the uncached one."""
    p, q = random_ids(5, 40), random_ids(6, 40)
    rounds = [[(p, 8)], [(q, 8)],
              [(p[:32] + random_ids(7, 8), 8), (p[:32] + random_ids(8, 8), 16), (random_ids(9, 40), 16), (random_ids(10, 40), 16)]]
    cached, plain = tiny(model, max_tokens_limit=16), tiny(model, max_tokens_limit=16, prefix_caching=False)
    engine = cached.engine()
    hashes = [engine.kv.prompt_hashes(ids, None) for ids in (p, q)]
    replies(cached, engine, rounds[:2])
    table = engine.kv
    assert len(table.lookup(hashes[0])) == len(table.lookup(hashes[1])) == 2 and table.used_tokens == 0
    last = [Sequence(cached.validate(ids, n, ignore_eos=True)) for ids, n in rounds[2]]
    for seq in last:
        engine.add(seq)
    engine.step()
    assert engine.running == last  # shared blocks counted once: 1 + 2 + 4 + 4 new blocks, 2 shared, 2 evicted
    assert table.lookup(hashes[1]) == [] and len(table.lookup(hashes[0])) == 2
    assert table.used_tokens == 13 * BLOCK_SIZE
    run(engine, [])
    assert [s.cached_tokens for s in last] == [32, 32, 0, 0]
    assert [s.output_ids for s in last] == [s.output_ids for s in replies(plain, plain.engine(), rounds)[2]]
    assert engine.kv_tokens == 0


def test_the_kv_budget_counts_a_shared_block_once(model):
    """6 blocks: two requests of 4 blocks each fit at once only because they share 2."""
    p = random_ids(11, 40)
    for caching, admitted in ((True, 2), (False, 1)):
        llm = tiny(model, kv_cache_tokens=6 * BLOCK_SIZE, prefix_caching=caching)
        engine = llm.engine()
        replies(llm, engine, [[(p, 8)]])
        for tail in (12, 13):
            engine.add(Sequence(llm.validate(p[:32] + random_ids(tail, 8), 16)))
        engine.step()
        assert len(engine.running) == admitted
        assert engine.kv_tokens == (4 + 4 - 2 if caching else 4) * BLOCK_SIZE


def test_the_engine_reports_the_prompt_tokens_it_looked_up_and_found(model):
    """What the prefix-cache metrics count: every admitted prompt's tokens looked up while the cache is
    on (none while off), and those found."""
    class Admissions(EngineMetrics):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int, int]] = []

        def admitted(self, prompt_tokens: int, queried_tokens: int, cached_tokens: int) -> None:
            self.seen.append((prompt_tokens, queried_tokens, cached_tokens))

    for caching, expected in ((True, [(40, 40, 0), (40, 40, 32)]), (False, [(40, 0, 0), (40, 0, 0)])):
        llm, admissions = tiny(model, prefix_caching=caching), Admissions()
        replies(llm, llm.engine(admissions), [[(A, 4)], [(A, 4)]])
        assert admissions.seen == expected


def test_requests_share_cached_blocks_only_with_their_own_cache_salt(model, llm):
    engine = llm.engine()
    salts = [None, "tenant-a", "tenant-b", "tenant-a", None]
    seqs = [replies(llm, engine, [[(A, 4)]], cache_salt=salt)[0][0] for salt in salts]
    assert [s.cached_tokens for s in seqs] == [0, 0, 0, 32, 32]
    assert len({s.output_ids[0] for s in seqs}) == 1


def test_a_failed_step_or_prefix_caching_off_leaves_nothing_to_reuse(model, llm):
    engine = llm.engine()
    replies(llm, engine, [[(A, 4)]])
    assert engine.kv.cached_blocks == 2
    engine.fail_all("a device error")
    assert engine.kv.cached_blocks == 0
    assert replies(llm, engine, [[(A, 4)]])[0][0].cached_tokens == 0
    off = tiny(model, prefix_caching=False)
    engine = off.engine()
    assert [replies(off, engine, [[(A, 4)]])[0][0].cached_tokens for _ in range(2)] == [0, 0]
    assert engine.kv.cached_blocks == 0


def test_block_hashes_chain_and_name_the_model_and_the_salt():
    one, other = BlockHasher("model\0torch.float32\0abc"), BlockHasher("model\0torch.bfloat16\0abc")
    assert one.root(None) != other.root(None) and one.root(None) != one.root("salt") != one.root("salt2")
    chain = one.chain(one.root(None), A)
    assert len(chain) == 2 and chain == one.chain(one.root(None), A[:39])  # full blocks only
    assert one.chain(one.root(None), A[16:32]) != chain[1:]  # a block's hash depends on every block before it
    assert one.chain(chain[0], A[16:32]) == chain[1:]
