"""Our CPU kernels (llm/kernels.cpp) against their definitions, and the bfloat16 head's exactness, at every
instruction-set level (``kernels.LEVELS``, conftest's ``level``) the test machine executes: a machine with
AVX512-BF16 proves the AVX-512 and AVX2 paths too; one with AVX2 only skips the levels above it, saying
which flags it lacks. Where none runs the engine uses oneDNN and the compiled graph's attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import Letters, head_dim_64_model
from llm import kernels
from llm import model as M


@pytest.mark.parametrize("m, n, k", [(1, 960, 576), (4, 64, 576), (5, 577, 101), (16, 3072, 576), (37, 130, 544), (1, 5, 31),
                                     (300, 200, 600), (0, 64, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("float32", [False, True])
def test_bf16_linear_is_the_product_summed_in_float32(level, m, n, k, bias, float32):
    """Every row count (a decode step's few, a prompt chunk's many), ragged N and odd K, bias or not,
    bfloat16 or float32 out: the float32 product of the bfloat16 operands, to float32's rounding."""
    torch.manual_seed(m + n + k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n) if bias else None
    got = kernels.ops.bf16_linear(x, kernels.ops.bf16_pack(w), n, b, float32)
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == (torch.float32 if float32 else torch.bfloat16) and got.shape == (m, n)
    if float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got, expected.bfloat16(), rtol=2**-7, atol=1e-2)


def test_the_amx_level_multiplies_on_tiles_and_no_other_does(level):
    """The AMX level's products run on AMX's tiles (kernels_amx.h), so its tests above prove them; a level
    below it never takes them. Where Linux lends no tiles the load log says the AVX512-BF16 loops run."""
    assert kernels.ops.tiles() == (level == "amx")
    assert kernels.describe() == f"our {kernels.LEVELS[level][2]} kernels"


def test_bf16_linear_takes_strided_rows(level):
    x, w = torch.randn(8, 128).bfloat16(), torch.randn(64, 64).bfloat16()
    packed = kernels.ops.bf16_pack(w)
    view = x[::2, 32:96]  # neither row nor column contiguous as a whole
    torch.testing.assert_close(kernels.ops.bf16_linear(view, packed, 64, None, False),
                               kernels.ops.bf16_linear(view.contiguous(), packed, 64, None, False))


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("rows, columns, heads, kv_heads", [(1, 64, 9, 3), (16, 640, 9, 3), (3, 37, 8, 8), (5, 17, 32, 8)])
@pytest.mark.parametrize("sharpness", [1, 40])
def test_paged_attention_reads_the_paged_cache_in_place_for_decode_rows(level, dim, rows, columns, heads, kv_heads,
                                                                         sharpness):
    """Against the graph's own attention (llm/model.py's gather, softmax and matmuls) in float32:
    scattered slots, ragged lengths (one position, a block and one, every column), grouped heads; scores
    of order 1, and of order 100 (a softmax near one-hot: the kernel's exp far below the maximum)."""
    torch.manual_seed(rows * columns)
    k_cache, v_cache = torch.randn(kv_heads, 4096, dim).bfloat16(), torch.randn(kv_heads, 4096, dim).bfloat16()
    q = (torch.randn(rows, heads, dim) * sharpness).bfloat16()
    slots = torch.randint(0, 4096, (rows, columns))
    lengths = torch.tensor([[1, 17, columns][i % 3] for i in range(rows)])
    got = kernels.ops.paged_attention(q, k_cache, v_cache, slots, lengths, dim**-0.5)
    assert M._in_place(q)  # so the compiled graph takes this path for bfloat16
    with kernels.using(None):
        expected = M.decode_attention(q.float(), k_cache.float(), v_cache.float(), slots, lengths, dim**-0.5)
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-2)


def test_a_mixed_steps_prompt_chunks_attend_in_place_as_the_gathered_attention_does(level):
    """A mixed step's decode rows and prompt chunks (one from position 0, one from the middle of its
    sequence) all go through the kernel, each chunk token over its sequence's slots up to itself: the
    result is the gathered, causally masked attention's (float32), and nothing is gathered (no index op)."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    k_cache, v_cache = torch.randn(kv_heads, 2048, dim).bfloat16(), torch.randn(kv_heads, 2048, dim).bfloat16()
    first, middle = torch.randperm(2048)[:40], torch.randperm(2048)[:300]
    context = M.Context()
    context.step = M.MixedStep(torch.randint(0, 2048, (2, 90)), torch.tensor([90, 3]),
                               [M.PrefillChunk(2, 40, 0, first), M.PrefillChunk(42, 44, 256, middle)])
    q = torch.randn(86 + 2, heads, dim).bfloat16()  # 2 decode rows, 40 + 44 chunk tokens, 2 padding
    with torch.profiler.profile() as trace:
        got = M.mixed_attention(q, k_cache, v_cache, context.key)
    ops = {event.key for event in trace.key_averages()}
    assert f"triton_chat_{level}::paged_attention" in ops and not ops & {"aten::index_select", "aten::index"}, ops
    with kernels.using(None):
        expected = M.mixed_attention(q.float(), k_cache.float(), v_cache.float(), context.key)
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-2)
    assert not got[86:].any()  # padding tokens: zeros


@pytest.fixture(scope="module")
def reply(model_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """The default model's output layer in bfloat16, and the final hidden states of a greedy reply (float32,
    as the decoder hands them to the head)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                          output_hidden_states=True, return_dict_in_generate=True)
    hidden = torch.cat([step[-1][0] for step in out.hidden_states])  # every prompt and reply position
    return hf.lm_head.weight.detach().bfloat16(), hidden  # a bfloat16 model's weights: float32 is their upcast


@pytest.fixture
def head(level, reply) -> tuple[M.Head, torch.Tensor, torch.Tensor]:
    """The bfloat16 head on ``level``'s kernel, its float32 weights, and the reply's hidden states."""
    weight, hidden = reply
    return M.Head(weight, M.Context()), weight.float(), hidden


def test_the_bfloat16_head_picks_float32s_token_at_every_position(head):
    """Greedy over the bfloat16 head is float32's choice, position by position, and the top candidates'
    logits are float32's exactly; the rest lie within the bound the head assumes."""
    bf16_head, weight, hidden = head
    assert bf16_head.fast
    with torch.inference_mode():
        got, expected = bf16_head(hidden), hidden @ weight.T
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    top = expected.topk(4, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), expected.gather(1, top), rtol=1e-6, atol=1e-5)
    bound = bf16_head.error * hidden.norm(dim=-1, keepdim=True)
    assert ((got - expected).abs() <= bound).all()


def test_near_ties_pick_float32s_token(head):
    """Hidden states moved so that the best two tokens' float32 logits differ by less than bfloat16 can
    tell apart, either way round."""
    bf16_head, weight, hidden = head
    h, first, second = near_ties(weight, hidden)
    with torch.inference_mode():
        got, expected = bf16_head(h), h @ weight.T
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert set(expected.argmax(-1).tolist()) == {first, second}  # the ties are real


def test_a_row_with_more_near_the_top_than_it_rescores_is_computed_whole(head):
    """With a single candidate re-scored, a near tie leaves the runner-up's upper bound above the best
    lower bound: the row comes whole from float32, and greedy still picks float32's token."""
    bf16_head, weight, hidden = head
    h, _, _ = near_ties(weight, hidden)
    bf16_head.CANDIDATES = 1
    try:
        with torch.inference_mode():
            got, expected = bf16_head(h), h @ weight.T
    finally:
        del bf16_head.CANDIDATES
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)  # every logit float32's, not only the top


def near_ties(weight: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Hidden states whose best two tokens differ by +-1e-4 and +-3e-3 in float32 (the real position
    whose best two are closest, moved along their difference), and those two tokens."""
    top = (hidden @ weight.T).topk(2, dim=-1)
    i = (top.values[:, 0] - top.values[:, 1]).argmin()
    first, second = top.indices[i].tolist()
    a, b = weight[first], weight[second]
    cases = [hidden[i] + (gap - (a - b) @ hidden[i]) / (a - b).norm() ** 2 * (a - b) for gap in (1e-4, -1e-4, 3e-3, -3e-3)]
    return torch.stack(cases), first, second


def test_a_compiled_bfloat16_engine_runs_the_kernels_in_one_graph_and_compiles_nothing_under_traffic(level):
    """The kernels are opaque operators inside the compiled step (no graph break, which would cut the
    step into a graph per layer), and traffic of every row count compiles nothing more."""
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    from llm import LLM, LLMConfig
    from llm.compiles import COMPILATIONS
    from llm.sequence import Sequence

    hf = head_dim_64_model(positions=256).to(torch.bfloat16)

    llm = LLM(LLMConfig("unused", compile=True, kv_cache_tokens=1024, default_max_tokens=8, max_tokens_limit=32, max_running_requests=8,
                        max_batched_tokens=32), torch.device("cpu"), hf, Letters())
    counters.clear()
    engine = llm.engine()
    assert not counters["graph_break"], dict(counters["graph_break"])
    built = COMPILATIONS.count
    seqs = [Sequence(llm.validate(list(range(1, 2 + 5 * i)), 8 + i, ignore_eos=True)) for i in range(8)]
    with profile() as trace:
        for i, seq in enumerate(seqs):
            engine.add(seq)
            engine.step()
        while engine.has_work:
            engine.step()
    assert COMPILATIONS.count == built and all(len(s.output_ids) == 8 + i for i, s in enumerate(seqs))
    ran = {event.name for event in trace.events()}
    assert {f"triton_chat_{level}::bf16_linear", f"triton_chat_{level}::paged_attention", "triton_chat::settled_logits"} <= ran
