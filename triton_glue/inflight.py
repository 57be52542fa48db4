"""The requests a model has accepted and not yet answered: bounded, and each answered exactly once."""

from __future__ import annotations

import itertools
import threading
from typing import Any


class InFlight:
    """Tickets for accepted requests, at most ``limit`` at once.

    ensemble_infer answers a request from the thread that called ``ensemble`` or, when that call is held
    by a Python stub that died (Triton 2.51 never answers it), from its guard thread. Whichever comes
    second finds the ticket gone, so a client never gets two final responses, and the slot is freed
    even though the stranded thread never returns.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._senders: dict[int, Any] = {}
        self._tickets = itertools.count()
        self._lock = threading.Lock()

    def admit(self, sender: Any) -> int | None:
        """A ticket for ``sender``, or None when ``limit`` requests are already in flight."""
        with self._lock:
            if len(self._senders) >= self.limit:
                return None
            ticket = next(self._tickets)
            self._senders[ticket] = sender
            return ticket

    def finish(self, ticket: int) -> Any | None:
        """The sender to answer on, the first time only; None if the ticket was already answered."""
        with self._lock:
            return self._senders.pop(ticket, None)

    def tickets(self) -> list[int]:
        with self._lock:
            return list(self._senders)

    def __len__(self) -> int:
        with self._lock:
            return len(self._senders)
