"""The reference generator: Hugging Face ``generate`` over the engine's own validated requests.

What the engine's replies are checked against (``tests/test_unit_engine.py``: token for token, greedy)
and the benchmark's static-batching baseline (``bench/static_llm.py``): one ``generate`` call per batch
on the Hugging Face modules themselves (``llm.load_model``: the engine's weights and dtype), the batch
running as long as its longest reply.

Its attention on the CPU is ``sdpa_gqa``: grouped-query attention without copying the KV cache every
step. Transformers' ``sdpa`` attention repeats each key/value head for its group of query heads
(``repeat_kv``) whenever there is an attention mask, and a batch always has one (left padding).
That copies the whole cache, times the group size, in every layer of every decode step: 26% of a step
for SmolLM2 (9 query heads over 3 KV heads) at 12 rows x 288 columns on 2 cores. PyTorch's SDPA takes
the grouped heads itself (``enable_gqa``, PyTorch 2.5+), and gives the same numbers. On CUDA the
fused kernels don't combine a mask with ``enable_gqa``, so GPUs keep ``sdpa``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, GenerationConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from llm import LLM, GenerationRequest

NAME = "sdpa_gqa"


def sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa; unregistered, there would be none


def use_grouped_attention(model: PreTrainedModel, device: torch.device) -> None:
    """Switch a model that runs ``sdpa`` on the CPU to ``sdpa_gqa``."""
    if device.type == "cpu" and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)


class StaticGenerator:
    def __init__(self, model: PreTrainedModel, llm: LLM) -> None:
        self.model = model
        self.llm = llm
        use_grouped_attention(model, llm.device)
        # This generator owns stopping: left in the model's config, generate() would fill EOS back in
        # whenever we pass none, and ignore_eos would stop at the end of turn anyway.
        model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def generate(self, batch: list[GenerationRequest]) -> list[list[int]]:
        """Greedy replies (new ids only, EOS excluded), each cut at its own ``max_tokens``.

        Prompts are left-padded with an attention mask so every row's last prompt token sits in the
        same column and one forward pass per step serves the whole batch. When a row ignores EOS the
        batch runs without it, and the other rows are cut at their first EOS afterwards.
        """
        llm = self.llm
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((len(batch), width), llm.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[row, width - len(r.input_ids):] = 1
        config = GenerationConfig(
            max_new_tokens=max(r.max_tokens for r in batch), do_sample=False,
            eos_token_id=None if any(r.ignore_eos for r in batch) else sorted(llm.eos_ids) or None,
            pad_token_id=llm.pad_id,
        )
        out = self.model.generate(
            input_ids=ids.to(llm.device), attention_mask=mask.to(llm.device), generation_config=config
        )
        replies = []
        for row, r in enumerate(batch):
            reply = []
            for token in out[row, width: width + r.max_tokens].tolist():
                if token in llm.eos_ids and not r.ignore_eos:
                    break
                reply.append(token)
            replies.append(reply)
        return replies
