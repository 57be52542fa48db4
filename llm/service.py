"""The engine's own thread: Triton's ``execute`` only submits requests; this thread steps and answers.

As in Triton's vllm_backend, each request's response sender has a single owner (this thread), which
checks for cancellation before every step and sends the final flag exactly once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from llm.engine import Engine, Sequence

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        respond: Callable[[Sequence], None],
        is_cancelled: Callable[[Sequence], bool],
        on_error: Callable[[str], None] = log.error,
    ) -> None:
        """``respond`` gets a sequence with new tokens (streaming) or finished; ``is_cancelled`` asks
        the transport whether its client has gone."""
        self.engine = engine
        self.respond = respond
        self.is_cancelled = is_cancelled
        self.on_error = on_error
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        self.engine.add(seq)
        self._wake.set()

    def stop(self, reason: str = "llm is unloading") -> None:
        """Finish the thread; whatever is still held gets an error, so no client waits forever."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        for seq in self.engine.sequences():
            seq.finish_reason, seq.error = "error", reason
            self._answer(seq)

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            for seq in self.engine.sequences():
                if self.is_cancelled(seq):
                    self.engine.cancel(seq)
            try:
                changed = self.engine.step()
            except Exception as e:  # OOM, a device error or a bug: the thread must live and answer everyone
                self.on_error(f"llm: step failed, {len(self.engine.running)} running requests lost: {e}")
                changed = self.engine.fail_all(f"generation failed: {e}")
            for seq in changed:
                if seq.stream or seq.finished:
                    self._answer(seq)

    def _answer(self, seq: Sequence) -> None:
        try:
            self.respond(seq)
        except Exception as e:  # a sender that fails (its client gone) must not stop the others
            self.on_error(f"llm: could not answer a request: {e}")
            self.engine.cancel(seq)
        seq.sent_tokens = len(seq.output_ids)
