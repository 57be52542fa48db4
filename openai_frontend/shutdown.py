"""The front end's graceful stop: SIGTERM (or Ctrl-C) drains, then exits; a second one exits at once.
SIGUSR1 drains without exiting: the launcher sends it when Triton starts draining beside the front end,
and SIGTERM once Triton has, so the front end keeps refusing with 503 until Triton is gone.

While it drains, ``/health`` says 503 (a load balancer stops sending), new generation requests are refused
with 503 and ``Retry-After``, and the requests in flight go on until they finish or the drain timeout
passes; a stream still running then gets an ``error`` event and ``[DONE]`` (a reply, a 503). Only then
does uvicorn's own shutdown close the port. Its timeout is ``DRAIN_TIMEOUT`` plus ``MARGIN``: when Triton
drains beside it (``make serve``, one Kubernetes pod), Triton's own ending reaches the client first.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("openai_frontend")

MARGIN = 3.0  # seconds past DRAIN_TIMEOUT before the front end ends a stream itself


class Drain:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds + MARGIN
        self.requested = False  # set from a signal handler; the loop begins the drain
        self.leave = False  # set by SIGTERM: exit once drained
        self.started = False
        self.in_flight = 0  # HTTP requests being answered, streams until their last byte
        self.expired = asyncio.Event()  # set at the deadline: streams still running end with an error
        self._deadline = 0.0

    def begin(self) -> None:
        """On the serving loop: refuse from now on, and set the deadline."""
        loop = asyncio.get_running_loop()
        self.started, self._deadline = True, loop.time() + self.seconds
        loop.call_later(self.seconds, self.expired.set)
        log.info("draining: new requests get 503; %d in flight get up to %g s to finish", self.in_flight, self.seconds)

    @property
    def done(self) -> bool:
        """Nothing left in flight, or a moment past the deadline for the errors to go out."""
        return self.started and (self.in_flight == 0 or asyncio.get_running_loop().time() > self._deadline + 1)


class Server(uvicorn.Server):
    """uvicorn, with ``Drain`` before its own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.drain.leave:  # the second signal: go now
            self.should_exit = self.force_exit = True
        self.drain.requested = self.drain.leave = True

    def drain_only(self, sig: int, frame: object) -> None:
        self.drain.requested = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain.requested and not self.drain.started:
            self.drain.begin()
        if self.drain.leave and self.drain.done:
            log.info("drained: stopping")
            self.should_exit = True
        return await super().on_tick(counter)
