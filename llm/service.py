"""The engine's port (``EngineLoop``) and its two threads: one steps the engine, one talks to the caller.

A caller (Triton's glue, the benchmark's static baseline has the same port) submits a validated
``GenerationRequest`` under a key of its own, may cancel it by that key, and receives ``Update``s: new
ids, their logprobs, and at the end the finish reason or the error. The engine's sequences hold engine
state only; where answers go stays with the caller, as vLLM's engine core takes typed requests in and
gives typed outputs out.

As in Triton's vllm_backend (``_response_loop``), talking to Triton is not the decode loop's business:
sending a response, asking whether a client cancelled and updating a metric each cross to the server
process, and the next step should not wait for them. The engine thread publishes which sequences
changed; the responder thread gives each everything new since its last update, so when sending falls
behind, an update carries several tokens instead of the queue growing, and the final one goes exactly
once. Each update costs every hop after the engine (a response, an ensemble step, a postprocess call, an
event to the client) the same whatever it carries, and on a CPU those hops take their time from the
engine's. So a streamed request's new tokens go at once only when its previous update has arrived
(``Deliveries``: postprocess says so, ``ipc/delivery.py``); while it is still on its way they wait and
join the next one. At low load nothing is on its way when the next token comes, and nothing waits; under
load an update carries every token made meanwhile, and no timer is involved. With a ``stream_interval``
above 1, a streamed request's update also waits until it holds that many new tokens (its first and its
final update never do), as vLLM's and SGLang's ``--stream-interval``.
The responder also lets the caller poll for cancellations, flushes the engine's metrics and, when
the server is stopping, ends what is left at the drain deadline and says when nothing is.

The engine thread also builds the engine: all of torch's work happens on that one thread. OpenMP gives
each thread that runs parallel work a team of its own, and libgomp, seeing more threads than cores, stops
its workers spinning between parallel regions: a decode step that loaded the model on Triton's thread
and ran on this one took twice as long (57 ms against 30 ms at one row, measured on 2 cores).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Callable, Protocol

from contract.schema import FinishReason
from llm.engine import Engine
from llm.request import GenerationRequest
from llm.sequence import Sequence, TokenLogprobs

log = logging.getLogger(__name__)

CANCEL_POLL_SECONDS = 0.05  # how often the transport is asked which clients have gone
ENGINE_THREAD, RESPONDER_THREAD = "llm-engine", "llm-responder"  # the two threads' names, in /proc too
METRICS_SECONDS = 0.1  # the engine's metrics reach the caller this often, and before each first and final update
HOLD_POLL_SECONDS = 0.0005  # while a stream's tokens wait for its previous response, how often to look again
HOLD_LIMIT_SECONDS = 1.0  # the longest they wait: a response lost on its way (a postprocess killed) holds nothing


def name_thread(name: str) -> None:
    """Give the calling OS thread ``name`` (at most 15 bytes), which ``top -H`` and /proc/PID/task/*/comm
    show and the benchmark reads to split a process's CPU by thread; Python names only its own objects."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is only a convenience
        pass


class Stopping(RuntimeError):
    """The server is stopping and this engine has already handed back everything it held."""


class Deliveries(Protocol):
    """Where each stream's responses are (``ipc/delivery.py``: postprocess says how far it has taken them)."""

    def changed(self) -> bool:
        """Whether anything was delivered since the last call."""

    def delivered(self, key: Hashable) -> int | None:
        """The ``completion_tokens`` of request ``key``'s latest update that arrived; None while none has."""


@dataclass(frozen=True)
class DrainDeadline:
    """The server is stopping: finish what is held, and at ``deadline`` (``time.time()``) end the rest."""

    deadline: float
    seconds: float  # the drain timeout, for the message the rest gets


@dataclass(frozen=True)
class Update:
    """What one request has that its caller was not given yet: its new ids (after the ids before them
    that their text needs), their logprobs when asked, and at the end why it finished. A request's
    updates come in order, the last one with ``finish_reason``, exactly once."""

    key: Hashable  # the caller's name for the request (``submit``)
    ids: list[int]  # output ids from a point the text of the new ones needs: the first ``sent_tokens`` were given before
    sent_tokens: int
    completion_tokens: int  # every id so far
    first: bool  # nothing was given before this update
    finish_reason: FinishReason | None = None
    error: str | None = None  # with a failed finish_reason
    logprobs: list[TokenLogprobs] | None = None  # one per id of ``ids``, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # in the first update, when the request asked
    stop_after: int = 0  # stop strings count only when they end after this character of ``ids``' text (min_tokens)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def failed(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.failed


@dataclass(eq=False)
class _Ticket:
    """The port's record of a submitted request: what its caller was given."""

    key: Hashable
    seq: Sequence
    every_token: bool
    coalesce: bool = False  # its deliveries are reported: new tokens wait while an update is on its way
    given: int = 0  # output ids in updates so far (every update but a final one carries at least one)
    given_at: float = 0.0  # when the latest update was given (time.monotonic())

    def due(self, interval: int) -> bool:
        """Whether a streamed request's new tokens make an update: its first, or ``interval`` of them.
        ``given`` is the responder's, read here on the engine thread: a stale value is smaller, so it can
        only make an update come early, never hold one back."""
        return self.every_token and (self.given == 0 or len(self.seq.output_ids) - self.given >= interval)


class EngineLoop:
    """The engine's port: ``submit`` a validated request under a key, ``cancel`` it, and receive its
    ``Update``s through ``on_update``; nothing of the transport enters the engine."""

    def __init__(
        self,
        build: Callable[[], Engine],
        on_update: Callable[[Update], None],
        poll: Callable[[], None] = lambda: None,
        on_error: Callable[[str], None] = log.error,
        draining: Callable[[], DrainDeadline | None] = lambda: None,
        on_drained: Callable[[], None] = lambda: None,
        stream_interval: int = 1,
        deliveries: Deliveries | None = None,
    ) -> None:
        """``build`` makes the engine (on the engine thread; its error is raised here); ``on_update``
        hands an update to the caller (on the responder thread; raising cancels that request); ``poll`` is
        called there every CANCEL_POLL_SECONDS, for the caller to ``cancel`` requests whose clients have
        gone; ``draining`` says whether the server is stopping, and ``on_drained`` is called once, when it
        is and every request taken has had its final update. A streamed request gets an update every
        ``stream_interval`` tokens; with ``deliveries``, not while its previous one is still on its way
        (the new tokens join the next one)."""
        self.on_update = on_update
        self.stream_interval = stream_interval
        self.deliveries = deliveries
        self.poll = poll
        self.on_error = on_error
        self.draining = draining
        self.on_drained = on_drained
        self._tickets: dict[Sequence, _Ticket] = {}  # submitted, final update not yet given
        self._keys: dict[Hashable, Sequence] = {}
        self._drained = False  # draining, and nothing held: no request is taken any more
        self._held_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._outbox: dict[Sequence, None] = {}  # changed since the responder last looked, in order
        self._deferred: dict[Sequence, None] = {}  # the responder's: new tokens, but the previous update is on its way
        self._deferred_looked = 0.0  # when the responder last looked at every deferred request
        self._outbox_ready = threading.Condition()
        self._polled = 0.0
        self._flushed = 0.0  # when the engine's metrics were last handed over (time.monotonic())
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build,), name=ENGINE_THREAD, daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self._responder = threading.Thread(target=self._respond_loop, name=RESPONDER_THREAD, daemon=True)
        self._responder.start()

    def submit(self, request: GenerationRequest, key: Hashable, every_token: bool = False, coalesce: bool = False) -> None:
        """Start generating ``request``; its updates carry ``key``: every new token when ``every_token``
        (with ``coalesce``, those made while its previous update is on its way, as ``deliveries`` reports,
        together in the next), else only the end. Raises ``Overloaded`` when the engine is full,
        ``Stopping`` once drained, and ``InvalidInput`` for a grammar this model cannot follow (built here,
        on the caller's thread)."""
        seq = Sequence(request)
        with self._held_lock:
            if self._drained:
                raise Stopping()
            self._tickets[seq] = _Ticket(key, seq, every_token, coalesce and self.deliveries is not None)
            self._keys[key] = seq
        try:
            self.engine.add(seq)
        except Exception:  # Overloaded, or InvalidInput for a grammar this model cannot follow
            self._forget(seq)
            raise
        self._wake.set()

    def cancel(self, key: Hashable, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """End the request ``key`` before the engine's next step, for ``reason``; its final update follows."""
        seq = self._keys.get(key)
        if seq is not None:
            self.engine.cancel(seq, reason, error)
            self._wake.set()

    def keys(self) -> list[Hashable]:
        """The requests not yet given their final update."""
        with self._held_lock:
            return list(self._keys)

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
        name_thread(ENGINE_THREAD)
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
            tickets, interval = self._tickets, self.stream_interval
            self._publish([s for s in changed if s.finished or (s in tickets and tickets[s].due(interval))])

    def _poll(self) -> None:
        """Let the caller cancel, and see whether the server is stopping, at most every CANCEL_POLL_SECONDS."""
        now = time.monotonic()
        if now - self._polled < CANCEL_POLL_SECONDS:
            return
        self._polled = now
        self.poll()
        drain = self.draining()
        if drain is None or self._drained:
            return
        if time.time() >= drain.deadline:
            for seq in self.engine.sequences():
                self.engine.cancel(seq, FinishReason.UNAVAILABLE, f"the server is stopping and its drain timeout "
                                    f"({drain.seconds:g} s) ended this reply after {len(seq.output_ids)} tokens; retry")
            self._wake.set()
        with self._held_lock:
            self._drained = not self._tickets
        if self._drained:
            self.on_drained()

    def _publish(self, seqs: list[Sequence]) -> None:
        if seqs:
            with self._outbox_ready:
                self._outbox.update(dict.fromkeys(seqs))
                self._outbox_ready.notify()

    def _respond_loop(self) -> None:
        name_thread(RESPONDER_THREAD)
        while True:
            with self._outbox_ready:
                if not self._outbox and not self._stopping:
                    self._outbox_ready.wait(HOLD_POLL_SECONDS if self._deferred else CANCEL_POLL_SECONDS)
                if self._stopping and not self._outbox:
                    return
            self._send_outbox()
            if time.monotonic() - self._flushed >= METRICS_SECONDS:
                self._flush_metrics()
            self._poll()

    def _flush_metrics(self) -> None:
        """Hand the engine's metrics over: every update of a Triton metric is a round trip to the server,
        so not with every token, but every METRICS_SECONDS and before a request's first and final updates
        (a client that reads the metrics after its first token sees its request running, after its reply
        every step it took)."""
        self._flushed = time.monotonic()
        self.engine.metrics.flush()

    def _defer(self, ticket: _Ticket, now: float) -> bool:
        """Whether ``ticket``'s new tokens wait for the next update: its previous one is on its way (as
        ``deliveries`` sees it), and not for long. Its first update never waits, nor anything once stopping."""
        if not ticket.coalesce or ticket.given == 0 or self._stopping or now - ticket.given_at > HOLD_LIMIT_SECONDS:
            return False
        return (self.deliveries.delivered(ticket.key) or 0) < ticket.given

    def _due(self) -> list[Sequence]:
        """The sequences to look at now: those the engine changed, and the deferred ones when something was
        delivered (or, every tenth of HOLD_LIMIT_SECONDS, to let out one whose update was lost)."""
        with self._outbox_ready:
            changed, self._outbox = self._outbox, {}
        if not self._deferred:
            return list(changed)
        now = time.monotonic()
        if self.deliveries.changed() or now - self._deferred_looked > HOLD_LIMIT_SECONDS / 10 or self._stopping:
            self._deferred_looked = now
            deferred, self._deferred = self._deferred, {}
            return list(deferred) + [seq for seq in changed if seq not in deferred]
        return [seq for seq in changed if seq not in self._deferred]

    def _send_outbox(self) -> None:
        now = time.monotonic()
        updates = []
        for seq in self._due():
            ticket = self._tickets.get(seq)
            if ticket is not None and self._defer(ticket, now):
                self._deferred[seq] = None
                continue
            update = None if ticket is None else _update(ticket)
            if update is not None:
                updates.append((seq, ticket, update))
        if any(update.first or update.finish_reason is not None for _, _, update in updates):
            self._flush_metrics()
        for seq, ticket, update in updates:
            try:
                self.on_update(update)
            except Exception as e:  # a sender that fails (its client gone) must not stop the others
                self.on_error(f"llm: could not answer a request: {e}")
                if update.finish_reason is None:  # end it; a final update that failed has nothing left to say
                    self.engine.cancel(seq)
                    continue
            ticket.given, ticket.given_at = update.completion_tokens, now
            if update.finish_reason is not None:
                self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        with self._held_lock:
            ticket = self._tickets.pop(seq)
            self._keys.pop(ticket.key, None)


def _update(ticket: _Ticket) -> Update | None:
    """Everything new for ``ticket``'s caller since its last update; None when there is nothing."""
    seq = ticket.seq
    finished = seq.finished  # read before the ids: a finished sequence's ids are all there
    reason = seq.finish_reason if finished else None
    first = ticket.given == 0
    if finished and reason.failed and first:  # nothing to carry but the error (it may never have been admitted)
        return Update(ticket.key, [], 0, len(seq.output_ids), True, reason, seq.error)
    count = len(seq.output_ids)
    if count == ticket.given and not finished:
        return None
    start = seq.stops.window(ticket.given)
    request = seq.request
    return Update(
        ticket.key, seq.output_ids[start:count], ticket.given - start, count, first, reason, seq.error,
        seq.token_logprobs[start:count] if request.top_logprobs is not None else None,
        seq.prompt_token_logprobs if first and request.prompt_logprobs is not None else None,
        seq.stops.stop_after(start), seq.cached_tokens,
    )
