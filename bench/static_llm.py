"""The static-batching generator that the in-flight engine replaced, kept as the benchmark's baseline.

One Hugging Face ``generate`` call per batch: the batch runs as long as its longest reply and new requests
wait for it to end. It answers the same validated ``GenerationRequest`` as the engine (greedy only), on
the Hugging Face modules themselves (``llm.load_model``: same weights and dtype as the engine's).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel

from bench.attention import use_grouped_attention
from llm import LLM, GenerationRequest


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
