"""The engine's own forward pass (llm/model.py) against Hugging Face's, for each supported family.

Tiny random models in float32: a prompt prefilled in two chunks, then decode steps, must give the logits
of the Hugging Face model run on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from llm import model as M

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),  # biases on q, k, v
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)),  # q and k norms
}


def scratch_rows(count: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows that read only the scratch slot 0."""
    return torch.zeros(count, 2, dtype=torch.long), torch.ones(count, dtype=torch.long)


@pytest.mark.parametrize("inline", [True, False], ids=["decode-rows-in-graph", "decode-rows-in-op"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_give_the_hugging_face_logits(family, inline):
    """A mixed step's decode rows attend inside the graph (CPUs) or in ``mixed_attention`` (GPUs)."""
    torch.manual_seed(0)
    hf = FAMILIES[family]().eval()
    decoder = M.Decoder(hf, slots=64, positions=64)
    ids = torch.randint(0, 128, (14,))
    slots = torch.arange(16, 30)  # the sequence's cache slots, position by position
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
        got = []
        for start, count in ((0, 6), (6, 4)):  # the prompt in two chunks, each after 2 scratch decode rows
            chunk = M.PrefillChunk(2, count, start, slots[: start + count])
            decoder.context.step = M.MixedStep(chunks=[chunk]) if inline else M.MixedStep(*scratch_rows(), [chunk])
            zeros = torch.zeros(2, dtype=torch.long)
            positions = torch.cat([zeros, torch.arange(start, start + count)])
            logits = decoder.mixed(torch.cat([zeros, ids[start:start + count]]), positions,
                                   torch.cat([zeros, slots[start:start + count]]), torch.arange(2, 2 + count),
                                   *(scratch_rows() if inline else ()))
            got.append(logits)
        for p in range(10, 14):  # then one token at a time, beside a scratch row
            logits = decoder.decode(torch.tensor([ids[p], 0]), torch.tensor([p, 0]), torch.tensor([slots[p], 0]),
                                    torch.stack([slots[: p + 1], torch.zeros(p + 1, dtype=torch.long)]),
                                    torch.tensor([p + 1, 1]))
            got.append(logits[:1])
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-4, atol=1e-4)


def test_other_architectures_are_refused_by_name():
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"parameter 'model_dir': the engine runs Llama-shaped decoders .* 'gpt2'"):
        M.Decoder(hf, slots=32, positions=32)


def test_a_decoders_packed_weights_and_step_are_its_own_and_go_with_it():
    """No module-level state: two decoders keep their own context (packed weights, mixed step), and a
    decoder's context is freed with it, its key free for the next one."""
    import gc

    gc.collect()  # earlier tests' decoders go now, not midway (their keys, lower, would be reused first)
    torch.manual_seed(0)
    first, second = (M.Decoder(FAMILIES["llama"]().eval(), slots=16, positions=16) for _ in range(2))
    assert first.context.key != second.context.key and M.Context.of(second.context.key) is second.context
    assert first.context.packed is not second.context.packed
    key = second.context.key
    del second
    gc.collect()
    with pytest.raises(KeyError):
        M.Context.of(key)
    assert M.Decoder(FAMILIES["llama"]().eval(), slots=16, positions=16).context.key == key
