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
import subprocess
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
    """What the supervisor needs of tritonserver and the front end (launcher/tritonserver.py, launcher/frontend.py)."""

    process: subprocess.Popen

    def start(self) -> object: ...

    def ready(self) -> bool: ...


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
    ready_since: float | None = field(default_factory=time.monotonic)  # None: started again, not ready yet

    def next_delay(self, code: int) -> float:
        """Seconds to wait before starting the child again; raises RuntimeError past the limit."""
        now = time.monotonic()
        if self.ready_since is not None and now - self.ready_since > HEALTHY_SECONDS:
            self.backoff = FIRST_BACKOFF
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            raise RuntimeError(f"{self.name} ended ({ending(code)}) after {len(self.times)} restarts within "
                               f"{self.window:g} s (RESTART_LIMIT, RESTART_WINDOW): giving up")
        self.times.append(now)
        delay, self.backoff = self.backoff, min(MAX_BACKOFF, self.backoff * 2)
        return delay


@dataclass
class Watched:
    """One child as the supervisor sees it: running, waiting out its backoff (``restart_at``), or started
    again and not yet ready (``starting_since``). Kept as state, not as a blocking wait, so that one child's
    backoff or start-up never hides the other's death (a front end restarted while tritonserver is down is
    not ready until tritonserver is)."""

    child: Child
    policy: Restarts
    restart_at: float | None = None
    starting_since: float | None = None


def keep_serving(children: dict[str, Child], state: State, on_triton_exit: Callable[[], None],
                 startup_timeout: float) -> NoReturn:
    """Until interrupted (KeyboardInterrupt) or a child fails past its limit (RuntimeError): each child that
    ends is logged and started again after its backoff; one not ready ``startup_timeout`` seconds after it
    was started again is killed, and counts as a failure. ``on_triton_exit`` ends the stubs a dead
    tritonserver left."""
    limit, window = limits()
    watched = {name: Watched(child, Restarts(name, limit, window)) for name, child in children.items()}
    while True:
        time.sleep(POLL_SECONDS)
        for name, w in watched.items():
            _look(name, w, state, on_triton_exit, startup_timeout)


def _look(name: str, w: Watched, state: State, on_triton_exit: Callable[[], None], startup_timeout: float) -> None:
    now, process = time.monotonic(), w.child.process
    if w.restart_at is not None:
        if now >= w.restart_at:
            w.restart_at, w.starting_since, w.policy.ready_since = None, now, None
            w.child.start()
            state.restarts[name] = state.restarts.get(name, 0) + 1
            if name == "tritonserver":
                state.triton_pid = w.child.process.pid
            state.write()
        return
    code = process.poll()
    if code is not None:
        delay = w.policy.next_delay(code)
        log.error("%s ended unexpectedly (%s); starting it again in %g s (restart %d of at most %d in %g s)",
                  name, ending(code), delay, len(w.policy.times), w.policy.limit, w.policy.window)
        if name == "tritonserver":
            on_triton_exit()
        w.restart_at, w.starting_since = time.monotonic() + delay, None
    elif w.starting_since is not None:
        if w.child.ready():
            log.info("%s is serving again", name)
            w.starting_since, w.policy.ready_since = None, time.monotonic()
        elif now - w.starting_since > startup_timeout:
            log.error("%s did not come back within %g s: ending it", name, startup_timeout)
            os.killpg(process.pid, signal.SIGKILL)  # started with start_new_session: it and its children
