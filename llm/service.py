"""The engine's two threads: one steps the engine, one talks to the transport.

Triton's ``execute`` only submits requests. As in Triton's vllm_backend (``_response_loop``), talking to
Triton is not the decode loop's business: sending a response, asking whether a client cancelled and
updating a metric each cross to the server process, and the next step should not wait for them. The
engine thread publishes which sequences changed; the responder thread answers each with everything new
since its last answer, so when sending falls behind, a response carries several tokens instead of the
queue growing. Each request's answers have one owner (the responder), which sends the final flag exactly
once. The responder also polls for cancellations, flushes the engine's metrics and, when the server is
stopping, ends what is left at the drain deadline and says when nothing is.

The engine thread also builds the engine: all of torch's work happens on that one thread. OpenMP gives
each thread that runs parallel work a team of its own, and libgomp, seeing more threads than cores, stops
its workers spinning between parallel regions: a decode step that loaded the model on Triton's thread
and ran on this one took twice as long (57 ms against 30 ms at one row, measured on 2 cores).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from contract.schema import FinishReason
from llm.engine import Engine
from llm.sequence import Overloaded, Sequence

log = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.05  # how often the transport is asked which clients have gone


class Stopping(RuntimeError):
    """The server is stopping and this engine has already handed back everything it held."""


@dataclass(frozen=True)
class Ending:
    """Why the transport wants a request stopped: ``CANCELLED`` (its client went away) or a failure."""

    reason: FinishReason
    error: str | None = None


@dataclass(frozen=True)
class Drain:
    """The server is stopping: finish what is held, and at ``deadline`` (``time.time()``) end the rest."""

    deadline: float
    seconds: float  # the drain timeout, for the message the rest gets


class EngineLoop:
    def __init__(
        self,
        build: Callable[[], Engine],
        respond: Callable[[Sequence], bool],
        ending: Callable[[Sequence], Ending | None],
        on_error: Callable[[str], None] = log.error,
        draining: Callable[[], Drain | None] = lambda: None,
        on_drained: Callable[[], None] = lambda: None,
    ) -> None:
        """``build`` makes the engine (on the engine thread; its error is raised here); ``respond`` answers
        a sequence with its new tokens (streaming) or its end, sets ``sent_tokens`` and says whether that
        was the final answer; ``ending`` asks the transport whether a request must stop (its client has
        gone); ``draining`` whether the server is stopping, and ``on_drained`` is called once, when it is
        and every request taken has had its final answer."""
        self.respond = respond
        self.ending = ending
        self.on_error = on_error
        self.draining = draining
        self.on_drained = on_drained
        self._held: set[Sequence] = set()  # submitted, final answer not yet sent
        self._drained = False  # draining, and nothing held: no request is taken any more
        self._held_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._outbox: dict[Sequence, None] = {}  # changed since the responder last looked, in order
        self._outbox_ready = threading.Condition()
        self._polled = 0.0
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build,), name="llm-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self._responder = threading.Thread(target=self._respond_loop, name="llm-responder", daemon=True)
        self._responder.start()

    def submit(self, seq: Sequence) -> None:
        """Hand ``seq`` to the engine; raises ``Overloaded`` when it is full, ``Stopping`` once drained."""
        with self._held_lock:
            if self._drained:
                raise Stopping()
            self._held.add(seq)
        try:
            self.engine.add(seq)
        except Overloaded:
            with self._held_lock:
                self._held.discard(seq)
            raise
        self._wake.set()

    def stop(self, reason: str = "llm is unloading") -> None:
        """Finish both threads; whatever is still held gets an error, so no client waits forever."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        with self._outbox_ready:
            self._outbox_ready.notify()
        self._responder.join()
        for seq in self.engine.sequences():
            seq.finish_reason, seq.error = FinishReason.ERROR, reason
            self._publish([seq])
        self._send_outbox()

    def _run(self, build: Callable[[], Engine]) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # raised again on the caller's thread: the model fails to load, and says why
            self._build_error = e
            return
        finally:
            self._built.set()
        while not self._stopping:
            if not self.engine.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                changed = self.engine.step()
            except Exception as e:  # OOM, a device error or a bug: the thread must live and answer everyone
                self.on_error(f"llm: step failed, {len(self.engine.running)} running requests lost: {e}")
                changed = self.engine.fail_all(f"generation failed: {e}")
            self._publish([s for s in changed if s.stream or s.finished])

    def _poll(self) -> None:
        """Ask the transport about every held request, and whether the server is stopping, at most every
        CANCEL_POLL_SECONDS."""
        now = time.monotonic()
        if now - self._polled < CANCEL_POLL_SECONDS:
            return
        self._polled = now
        for seq in self.engine.sequences():
            ending = None if seq.finished else self.ending(seq)
            if ending is not None:
                self.engine.cancel(seq, ending.reason, ending.error)
                self._wake.set()
        drain = self.draining()
        if drain is None or self._drained:
            return
        if time.time() >= drain.deadline:
            for seq in self.engine.sequences():
                self.engine.cancel(seq, FinishReason.UNAVAILABLE, f"the server is stopping and its drain timeout "
                                    f"({drain.seconds:g} s) ended this reply after {len(seq.output_ids)} tokens; retry")
            self._wake.set()
        with self._held_lock:
            self._drained = not self._held
        if self._drained:
            self.on_drained()

    def _publish(self, seqs: list[Sequence]) -> None:
        if seqs:
            with self._outbox_ready:
                self._outbox.update(dict.fromkeys(seqs))
                self._outbox_ready.notify()

    def _respond_loop(self) -> None:
        while True:
            with self._outbox_ready:
                if not self._outbox and not self._stopping:
                    self._outbox_ready.wait(CANCEL_POLL_SECONDS)
                if self._stopping and not self._outbox:
                    return
            self._send_outbox()
            self._poll()

    def _send_outbox(self) -> None:
        with self._outbox_ready:
            seqs, self._outbox = list(self._outbox), {}
        self.engine.metrics.flush()  # before the answers: a client that reads metrics after one sees its step
        for seq in seqs:
            if seq.answered:
                continue
            try:
                seq.answered = self.respond(seq)
            except Exception as e:  # a sender that fails (its client gone) must not stop the others
                self.on_error(f"llm: could not answer a request: {e}")
                self.engine.cancel(seq)
            if seq.answered:
                with self._held_lock:
                    self._held.discard(seq)
