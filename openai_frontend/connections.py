"""Each client connection's send buffer, bounded, and the cut of a client that reads nothing.

Why: a stream's events are produced whether its client reads them or not, and a client that stops reading
(a hung process, a paused tab) would hold what it did not read in this process's and the kernel's buffers,
which grow on their own (Linux's send buffer autotunes to 4 MB), and keep its row in ``llm`` generating to
the end. So each connection's buffers are capped at ``send_buffer`` bytes (the socket's ``SO_SNDBUF``, and
asyncio's write buffer past which writing pauses), and a connection whose client reads nothing of them for
``stall_timeout`` seconds is reset: uvicorn sees a client that went away, and the request's generations are
cancelled as for any disconnect (openai_frontend/answer.py), freeing the row.

uvicorn exposes neither to an application, so this is its HTTP/1.1 protocol (h11) with both added.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

from prometheus_client import Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("openai_frontend")
NO_LINGER = struct.pack("ii", 1, 0)  # close with a reset: what the kernel still holds for the client is dropped


def protocol(send_buffer: int, stall_timeout: float, stalled: Counter) -> type[H11Protocol]:
    """uvicorn's ``http`` protocol class with these limits; ``stalled`` counts the connections reset."""

    class BoundedConnection(H11Protocol):
        stall: asyncio.TimerHandle | None = None
        waiting = 0  # bytes in asyncio's buffer at the last look: fewer later means the client read some

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            transport.set_write_buffer_limits(high=send_buffer)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.stall is None:
                self._start_clock()

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_clock()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_clock()
            super().connection_lost(exc)

        def _start_clock(self) -> None:
            self.waiting = self.transport.get_write_buffer_size()
            self.stall = self.loop.call_later(stall_timeout, self._look)

        def _stop_clock(self) -> None:
            if self.stall is not None:
                self.stall.cancel()
                self.stall = None

        def _look(self) -> None:
            """Writing is still paused: a client that read some since the last look (a slow one, kept
            behind by a faster stream) gets another ``stall_timeout``; one that read nothing is cut."""
            self.stall = None
            if self.transport.get_write_buffer_size() < self.waiting:
                self._start_clock()
                return
            host, port = self.client or ("?", 0)
            log.warning("%s:%s read nothing for %g s (OPENAI_STALL_TIMEOUT) with %d bytes waiting for it: its "
                        "connection is reset", host, port, stall_timeout, self.transport.get_write_buffer_size())
            stalled.inc()
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, NO_LINGER)
            self.transport.abort()  # connection_lost follows: the request sees its client gone

    return BoundedConnection
