"""Slow and stuck clients against uvicorn with the front end's connection limits
(openai_frontend/connections.py, the body deadline in openai_frontend/app.py), on a real socket, with no
Triton: a stream the client stops reading, and a body sent a byte a second."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from openai_frontend.app import _body
from openai_frontend.connections import protocol
from openai_frontend.api_errors import APIError

EVENT = b"data: " + b"x" * 1000 + b"\n\n"


class Running:
    """uvicorn on a free loopback port in a thread, with ``protocol``'s limits."""

    def __init__(self, send_buffer: int, stall_timeout: float, body_timeout: float) -> None:
        self.sent, self.closed = 0, threading.Event()
        self.stalled = Counter("stalled", "", registry=CollectorRegistry())
        routes = [Route("/stream", self.stream), Route("/body", self.body, methods=["POST"])]
        self.body_timeout = body_timeout
        http = protocol(send_buffer, stall_timeout, self.stalled)
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=0, http=http,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def stream(self, request: Request) -> StreamingResponse:
        async def events():
            try:
                for _ in range(100_000):  # 100 MB: far more than any buffer holds
                    yield EVENT
                    self.sent += 1
                    await asyncio.sleep(0)
            finally:
                self.closed.set()  # the front end's generators cancel their Triton streams here

        return StreamingResponse(events(), media_type="text/event-stream")

    async def body(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse({"bytes": len(await _body(request, 1 << 20, self.body_timeout))})
        except APIError as e:
            return e.response()

    def __enter__(self) -> "Running":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def connect(port: int, receive_buffer: int = 0) -> socket.socket:
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    return sock


def test_a_client_that_stops_reading_holds_a_bounded_buffer_and_is_reset_after_the_stall_timeout():
    with Running(send_buffer=16384, stall_timeout=1.0, body_timeout=30) as server:
        sock = connect(server.port, receive_buffer=4096)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert server.closed.wait(15), "the stream was never cut"
        assert server.stalled._value.get() == 1
        # Written before the cut: the client's window, the kernel's buffer (twice SO_SNDBUF) and asyncio's
        # (the same again), not the 100 MB the stream would have made.
        assert server.sent * len(EVENT) < 512 * 1024, server.sent
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):  # what it did get, then the reset
            while sock.recv(65536):
                pass
        sock.close()


def test_a_client_that_reads_slowly_but_steadily_is_not_cut():
    with Running(send_buffer=16384, stall_timeout=1.0, body_timeout=30) as server:
        sock = connect(server.port, receive_buffer=4096)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 4  # past the stall timeout four times over, reading 8 KB every 0.3 s
        while time.monotonic() < deadline:
            assert sock.recv(8192)
            time.sleep(0.3)
        assert server.stalled._value.get() == 0 and not server.closed.is_set()
        sock.close()
        assert server.closed.wait(15)  # and once it goes, its stream ends


def test_a_body_sent_a_byte_a_second_gets_a_408_that_names_the_setting_and_closes():
    with Running(send_buffer=65536, stall_timeout=30, body_timeout=1.5) as server:
        sock = connect(server.port)
        sock.sendall(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        sock.settimeout(10)
        started, reply = time.monotonic(), b""
        for byte in b'{"messages"':
            sock.sendall(bytes([byte]))
            time.sleep(0.5)
            sock.setblocking(False)
            try:
                reply += sock.recv(65536)
            except BlockingIOError:
                pass
            sock.setblocking(True)
            if reply:
                break
        while b"}" not in reply:
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and b"OPENAI_BODY_TIMEOUT" in reply, reply
        assert b"connection: close" in reply.lower() and time.monotonic() - started < 5
        assert sock.recv(65536) == b""  # closed: the rest of the body is never read
        sock.close()
