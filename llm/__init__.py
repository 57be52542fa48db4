"""Batched greedy generation with any local Hugging Face causal LM."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from serving.errors import InvalidInput

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LLMConfig:
    """``llm`` config parameters."""

    model_dir: str
    dtype: str = "auto"  # auto: bfloat16 on GPUs that support it, else float16; float32 on CPU
    default_max_tokens: int = 64
    max_tokens_limit: int = 512
    max_context_tokens: int = 0  # prompt + reply; 0 means the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"parameter 'dtype' must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"parameter 'default_max_tokens' must be in [1, max_tokens_limit={self.max_tokens_limit}], "
                f"got {self.default_max_tokens}"
            )
        if self.max_context_tokens < 0:
            raise ValueError(f"parameter 'max_context_tokens' must be >= 0, got {self.max_context_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: ids within the vocabulary, a reply budget that fits the context."""

    input_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False  # generate exactly max_tokens tokens (benchmarks, load tests)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def configure_threads(instance_count: int, device: torch.device) -> int:
    """Split the cores between CPU instances (each is its own stub process); GPU instances need few."""
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // max(1, instance_count)) if device.type == "cpu" else min(2, cores)
    torch.set_num_threads(threads)
    return threads


class Generator:
    """Runs one forward pass per decode step for a whole batch of prompts of different lengths."""

    def __init__(self, config: LLMConfig, device: torch.device, model: PreTrainedModel | None = None) -> None:
        self.config = config
        self.device = device
        self.model = model or AutoModelForCausalLM.from_pretrained(
            config.model_dir, dtype=resolve_dtype(config.dtype, device),
            local_files_only=True, trust_remote_code=False,
        )
        self.model.to(device).eval()
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        positions = getattr(self.model.config, "max_position_embeddings", None) or 2**31
        self.context_tokens = min(config.max_context_tokens or positions, positions)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        # The Generator owns stopping: left in the model's config, generate() would fill EOS back in
        # whenever we pass none, and ignore_eos would stop at the end of turn anyway.
        self.model.generation_config.eos_token_id = None

    def validate(self, input_ids: list[int], max_tokens: int | None, ignore_eos: bool = False) -> GenerationRequest:
        """One place for every per-request limit; raises ``InvalidInput`` naming field and range."""
        limit = self.config.max_tokens_limit
        max_tokens = self.config.default_max_tokens if max_tokens is None else max_tokens
        if not 1 <= max_tokens <= limit:
            raise InvalidInput(f"max_tokens must be in [1, {limit}], got {max_tokens}")
        if not input_ids:
            raise InvalidInput("input_ids must not be empty")
        bad = next((i for i in input_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidInput(
                f"input_ids holds token id {bad}, outside the model vocabulary [0, {self.vocab_size}): "
                "the tokenizer in preprocess does not match the llm model"
            )
        if len(input_ids) + max_tokens > self.context_tokens:
            raise InvalidInput(
                f"prompt is {len(input_ids)} tokens; with max_tokens={max_tokens} it exceeds the context of "
                f"{self.context_tokens} tokens (shorten the prompt or lower max_tokens)"
            )
        return GenerationRequest(list(input_ids), max_tokens, ignore_eos)

    @torch.inference_mode()
    def generate(self, batch: list[GenerationRequest]) -> list[list[int]]:
        """Greedy replies (new ids only, EOS excluded), each cut at its own ``max_tokens``.

        Prompts are left-padded with an attention mask so every row's last prompt token sits in the
        same column and one forward pass per step serves the whole batch. When a row ignores EOS the
        batch runs without it, and the other rows are cut at their first EOS afterwards.
        """
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[row, width - len(r.input_ids):] = 1
        config = GenerationConfig(
            max_new_tokens=max(r.max_tokens for r in batch), do_sample=False,
            eos_token_id=None if any(r.ignore_eos for r in batch) else sorted(self.eos_ids) or None,
            pad_token_id=self.pad_id,
        )
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config
        )
        replies = []
        for row, r in enumerate(batch):
            reply = []
            for token in out[row, width: width + r.max_tokens].tolist():
                if token in self.eos_ids and not r.ignore_eos:
                    break
                reply.append(token)
            replies.append(reply)
        return replies
