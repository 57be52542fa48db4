"""The static-batching generator that the in-flight engine replaced, kept as the benchmark's baseline.

One Hugging Face ``generate`` call per batch: the batch runs as long as its longest reply and new requests
wait for it to end. It answers the same validated ``GenerationRequest`` as the engine (greedy only), on
the Hugging Face modules themselves (``llm.load_model``: same weights and dtype as the engine's).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel

from bench.attention import use_grouped_attention
from contract.schema import FinishReason
from llm import LLM, GenerationRequest
from llm.service import Update

MAX_BATCH = 32  # as Triton's dynamic batcher formed them for this model (its max_batch_size)


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


class StaticLoop:
    """The engine's port (``llm.service.EngineLoop``'s ``submit``, ``cancel``, ``keys``, ``stop``) over static
    batching, so the shipped glue serves it unchanged: one thread takes every request waiting (up to
    MAX_BATCH), generates them to the end together, and gives each one final update; requests that arrive
    meanwhile wait for the next batch. ``build`` makes the generator on that thread, where torch works."""

    def __init__(self, build: Callable[[], StaticGenerator], on_update: Callable[[Update], None]) -> None:
        self.on_update = on_update
        self._waiting: dict[Hashable, GenerationRequest] = {}
        self._ready = threading.Condition()
        self._stopping = False
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build,), name="static-llm", daemon=True)
        self._thread.start()
        self._built.wait()

    def submit(self, request: GenerationRequest, key: Hashable, every_token: bool = False) -> None:
        with self._ready:
            self._waiting[key] = request
            self._ready.notify()

    def cancel(self, key: Hashable, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """A waiting request leaves the queue; a batch, once started, runs to its end (what static means)."""
        with self._ready:
            request = self._waiting.pop(key, None)
        if request is not None:
            self.on_update(Update(key, [], 0, 0, True, reason, error))

    def keys(self) -> list[Hashable]:
        with self._ready:
            return list(self._waiting)

    def stop(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join()
        for key in self.keys():
            self.cancel(key, FinishReason.ERROR, "llm is unloading")

    def _run(self, build: Callable[[], StaticGenerator]) -> None:
        generator = build()
        self._built.set()
        while True:
            with self._ready:
                while not self._waiting and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
                batch = list(self._waiting.items())[:MAX_BATCH]
                for key, _ in batch:
                    del self._waiting[key]
            replies = generator.generate([request for _, request in batch])
            for (key, request), reply in zip(batch, replies):
                reason = FinishReason.LENGTH if len(reply) == request.max_tokens else FinishReason.STOP
                self.on_update(Update(key, reply, 0, len(reply), True, reason))
