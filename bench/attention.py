"""Grouped-query attention on the CPU without copying the KV cache every step.

Transformers' ``sdpa`` attention repeats each key/value head for its group of query heads
(``repeat_kv``) whenever there is an attention mask, and the engine always has one (left padding).
That copies the whole cache, times the group size, in every layer of every decode step: 26% of a step
for SmolLM2 (9 query heads over 3 KV heads) at 12 rows x 288 columns on 2 cores. PyTorch's SDPA takes
the grouped heads itself (``enable_gqa``, PyTorch 2.5+), and gives the same numbers. On CUDA the
fused kernels don't combine a mask with ``enable_gqa``, so GPUs keep ``sdpa``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
