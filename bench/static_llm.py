"""The static batching the in-flight engine replaced, kept as the benchmark's baseline: the reference
generator (``llm/reference.py``, one Hugging Face ``generate`` call per batch) behind the engine's port,
so the batch runs as long as its longest reply and new requests wait for it to end.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Callable

from contract.schema import FinishReason
from llm import GenerationRequest
from llm.reference import StaticGenerator
from llm.service import Update

MAX_BATCH = 32  # as Triton's dynamic batcher formed them for this model (its max_batch_size)

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

    def submit(self, request: GenerationRequest, key: Hashable, every_token: bool = False, coalesce: bool = False) -> None:
        """EngineLoop.submit's: a static batch answers once, at its end, so neither flag changes anything."""
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
