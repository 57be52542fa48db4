"""Start, wait for and stop the processes the launcher runs: ports, health, process groups, the drain."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

import requests

log = logging.getLogger("launcher")

SETTLED_GRACE = 3.0  # seconds a stopping process gets to exit on its own once it is settled (stop_group)
# Seconds a stopping server lets the requests it holds finish before it ends them with an error
# (DRAIN_TIMEOUT); compose's stop_grace_period and Kubernetes' terminationGracePeriodSeconds leave room for it.
DEFAULT_DRAIN_TIMEOUT = 30.0
DRAIN_SLACK = 5.0  # past the drain timeout, for the errors that end what was left to reach their clients
# After a drain, unloading and exiting (SETTLED_GRACE included); measured under 6 s on 2 cores.
EXIT_AFTER_DRAIN = 10.0


def drain_timeout() -> float:
    """``DRAIN_TIMEOUT`` seconds from the environment (default 30; 0 ends what is running at once)."""
    raw = os.environ.get("DRAIN_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_DRAIN_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise RuntimeError(f"DRAIN_TIMEOUT must be a number of seconds >= 0, got {raw!r}")
    return seconds


class StopSignals:
    """SIGINT and SIGTERM as the launcher takes them. The first raises ``KeyboardInterrupt`` where the
    launcher is (it then stops everything, draining) and from then on none raises: a stop interrupted
    half-way would leave its children running. The second is only logged (``make`` forwards a SIGTERM
    its process group already got, so two come at once); a third sets ``hurry``: the drain ends now,
    and the children still end."""

    def __init__(self) -> None:
        self.hurry = threading.Event()
        self.count = 0

    def install(self) -> "StopSignals":
        for number in (signal.SIGTERM, signal.SIGINT):  # SIGINT too when started in the background
            signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: object) -> None:
        self.count += 1
        name = signal.Signals(number).name
        if self.count == 1:
            raise KeyboardInterrupt(name)
        if self.count == 2:
            log.warning("%s: already stopping (draining for up to %g s, DRAIN_TIMEOUT); once more ends the drain now",
                        name, drain_timeout())
        elif not self.hurry.is_set():
            log.warning("%s: ending the drain now", name)
            self.hurry.set()


def stop_group(process: subprocess.Popen | None, timeout: float, settled: Callable[[], bool] | None = None) -> bool:
    """SIGTERM a process started with ``start_new_session`` and its children, SIGKILL past ``timeout``, or
    sooner once ``settled()`` (it has nothing left to finish) has held for ``SETTLED_GRACE`` seconds
    without the process exiting. True when it was ended for that."""
    if not process or process.poll() is not None:
        return False
    os.killpg(process.pid, signal.SIGTERM)
    deadline, settled_at, early = time.monotonic() + timeout, None, False
    while process.poll() is None and time.monotonic() < deadline and not early:
        settled_at = (settled_at or time.monotonic()) if settled and settled() else None
        early = settled_at is not None and time.monotonic() - settled_at > SETTLED_GRACE
        time.sleep(0.2)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return early


def wait_healthy(url: str, process: subprocess.Popen | None, name: str, timeout: float, hint: str = "",
                 on_poll: Callable[[], None] = lambda: None) -> None:
    """Poll ``url`` until it answers 200; raise when ``process`` exits first or ``timeout`` passes.
    ``on_poll`` runs before each look."""
    suffix = f"; {hint}" if hint else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        on_poll()
        if process and process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}{suffix}")
        if answers(url):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{name} not ready after {timeout:.0f}s{suffix}")


def answers(url: str) -> bool:
    """One look: does ``url`` answer 200 (within 2 s)?"""
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    openai: int = 9000  # the OpenAI-compatible front end (launcher/frontend.py)

    @classmethod
    def from_env(cls) -> "Ports":
        return cls(
            int(os.environ.get("HTTP_PORT", 8000)),
            int(os.environ.get("GRPC_PORT", 8001)),
            int(os.environ.get("METRICS_PORT", 8002)),
            int(os.environ.get("OPENAI_PORT", 9000)),
        )

    @classmethod
    def free(cls) -> "Ports":
        return cls(free_port(), free_port(), free_port(), free_port())
