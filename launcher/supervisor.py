"""``make serve``'s supervisor: a child that dies is started again, with backoff, until told to stop.

Why: Triton 2.51 aborts on a shared-memory lock about once in 16 kills of a stub under load
(docs/operations.md#faults), and an OOM kill or a crash ends a process whatever the code. In a container
the restart policy brings it back; on bare metal, a VM or a notebook nothing did, and the service stayed
down. Here the launcher says why the child ended (its exit code or signal), ends the Python stubs a dead
tritonserver left behind, and starts it again after 1 s, doubling to 30 s, the count reset once it has
served a healthy minute; the front end answers 503 with ``Retry-After`` meanwhile. Past ``RESTART_LIMIT``
restarts of one child within ``RESTART_WINDOW`` seconds (5 in 600 by default) it gives up and says so:
something that fails that often needs a person.

What it has done is written to a small state file (``LAUNCHER_STATE``) that the front end reads: the
current tritonserver's pid, whose stubs it watches, and the restarts, which it serves as the metric
``launcher_restarts_total``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn, Protocol

log = logging.getLogger("launcher")

FIRST_BACKOFF, MAX_BACKOFF = 1.0, 30.0  # seconds before a restart, doubling from the first to the most
HEALTHY_SECONDS = 60.0  # up this long, a child's next failure starts the backoff over
POLL_SECONDS = 0.5


class Child(Protocol):
    """What the supervisor needs of tritonserver and the front end (launcher/triton.py, launcher/frontend.py)."""

    process: object

    def start(self) -> object: ...

    def wait_ready(self, timeout: float) -> None: ...


def limits() -> tuple[int, float]:
    """``RESTART_LIMIT`` (restarts of one child, 5) within ``RESTART_WINDOW`` seconds (600)."""
    try:
        limit, window = int(os.environ.get("RESTART_LIMIT", "5")), float(os.environ.get("RESTART_WINDOW", "600"))
    except ValueError:
        limit, window = -1, -1.0
    if limit < 0 or not 0 < window < float("inf"):
        raise RuntimeError(f"RESTART_LIMIT must be a count >= 0 and RESTART_WINDOW seconds > 0, got "
                           f"{os.environ.get('RESTART_LIMIT')!r} and {os.environ.get('RESTART_WINDOW')!r}")
    return limit, window


def ending(code: int) -> str:
    """How a process ended, in words: ``exit code 1``, ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class State:
    """The file the front end reads (``LAUNCHER_STATE``): the tritonserver's pid and the restarts so far."""

    path: Path
    triton_pid: int = 0
    restarts: dict[str, int] = field(default_factory=dict)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        draft = self.path.with_suffix(".tmp")
        draft.write_text(json.dumps({"triton_pid": self.triton_pid, "restarts": self.restarts}))
        os.replace(draft, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class Restarts:
    """One child's restart policy: the backoff, and the limit within the window."""

    name: str
    limit: int
    window: float
    times: deque = field(default_factory=deque)
    backoff: float = FIRST_BACKOFF
    started: float = field(default_factory=time.monotonic)

    def next_delay(self, code: int) -> float:
        """Seconds to wait before starting the child again; raises RuntimeError past the limit."""
        now = time.monotonic()
        if now - self.started > HEALTHY_SECONDS:
            self.backoff = FIRST_BACKOFF
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            raise RuntimeError(f"{self.name} ended ({ending(code)}) after {len(self.times)} restarts within "
                               f"{self.window:g} s (RESTART_LIMIT, RESTART_WINDOW): giving up")
        self.times.append(now)
        delay, self.backoff = self.backoff, min(MAX_BACKOFF, self.backoff * 2)
        return delay


def keep_serving(children: dict[str, Child], state: State, on_triton_exit: Callable[[], None],
                 startup_timeout: float) -> NoReturn:
    """Until interrupted (KeyboardInterrupt) or a child fails past its limit (RuntimeError): each child that
    ends is logged and started again after its backoff. ``on_triton_exit`` ends the stubs a dead
    tritonserver left."""
    limit, window = limits()
    policies = {name: Restarts(name, limit, window) for name in children}
    while True:
        time.sleep(POLL_SECONDS)
        for name, child in children.items():
            code = child.process.poll()
            if code is None:
                continue
            policy = policies[name]
            delay = policy.next_delay(code)
            log.error("%s ended unexpectedly (%s); starting it again in %g s (restart %d of at most %d in %g s)",
                      name, ending(code), delay, len(policy.times), limit, window)
            if name == "tritonserver":
                on_triton_exit()
            time.sleep(delay)
            _restart(name, child, state, startup_timeout)
            policy.started = time.monotonic()


def _restart(name: str, child: Child, state: State, startup_timeout: float) -> None:
    child.start()
    state.restarts[name] = state.restarts.get(name, 0) + 1
    if name == "tritonserver":
        state.triton_pid = child.process.pid
    state.write()
    try:
        child.wait_ready(timeout=startup_timeout)
    except (RuntimeError, TimeoutError) as e:  # it failed again: the loop sees it ended (or ends it) and counts it
        log.error("%s did not come back: %s", name, e)
        return
    log.info("%s is serving again", name)
