"""A graceful stop, told to a tritonserver's models by whoever stops it, and llm's word that it is done.

Triton 2.51 cannot drain a streaming ensemble itself: on SIGTERM every model's scheduler refuses new
requests at once, postprocess's included, so each stream in flight fails at its next token. So whoever
stops Triton (``launcher/tritonserver.py``) first posts a notice named by the server's pid: preprocess refuses
new requests (UNAVAILABLE), llm lets what it holds finish until the notice's deadline, ends the rest with
an error, and leaves a note named by its stub's pid once it holds nothing. Only then does Triton get its
SIGTERM, with nothing left in flight. Files in the cancel board's directory are the one channel every
model instance and the launcher share without Triton in between.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ipc import stubs
from ipc.cancel import BOARD


@dataclass(frozen=True)
class Notice:
    deadline: float  # time.time() when whatever is still running gets an error
    seconds: float  # the drain timeout it was posted with, for messages


def _notice_path(server_pid: int) -> Path:
    return BOARD / f"drain-{server_pid}"


def _done_path(stub_pid: int) -> Path:
    return BOARD / f"drained-{stub_pid}"


def _running_since(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), or None once it has exited. A zombie, killed but not
    yet reaped (a container whose init does not reap leaves them for good), has exited; the start time
    tells a process from a later one given the same pid."""
    fields = stubs.stat(pid)
    return fields[stubs.START_TIME] if fields and fields[0] not in ("Z", "X") else None


def begin(server_pid: int, seconds: float) -> Notice:
    """Tell ``server_pid``'s models to drain for up to ``seconds``."""
    notice = Notice(time.time() + seconds, seconds)
    BOARD.mkdir(parents=True, exist_ok=True)
    draft = BOARD / f".drain-{server_pid}.{os.getpid()}"
    draft.write_text(f"{notice.deadline} {notice.seconds} {_running_since(server_pid)}")
    os.replace(draft, _notice_path(server_pid))
    return notice


def _read(server_pid: int) -> tuple[Notice, str] | None:
    try:
        deadline, seconds, since = _notice_path(server_pid).read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    return Notice(float(deadline), float(seconds)), since


def notice(server_pid: int) -> Notice | None:
    """The drain notice of ``server_pid``, if one was posted for the process running now. The notice of
    a server that died without clearing it (its launcher killed mid-drain) does not count, whether the
    server is gone, a zombie, or its pid now another process's: a container restarted in the same pod
    keeps /dev/shm (an emptyDir) and its new tritonserver often gets the same pid."""
    read = _read(server_pid)
    return read[0] if read and read[1] == _running_since(server_pid) else None


def posted() -> bool:
    """Whether any running server on this host (the one of a container) is draining."""
    return any(notice(int(path.name.removeprefix("drain-"))) for path in BOARD.glob("drain-*"))


def done(stub_pid: int) -> None:
    """llm's stub ``stub_pid`` holds nothing any more: every request it took has had its final answer."""
    _done_path(stub_pid).touch()


def drained(stub_pids: list[int]) -> bool:
    return all(_done_path(pid).exists() for pid in stub_pids)


def clear(server_pid: int, stub_pids: list[int]) -> None:
    """Remove the notice and the notes once the server is gone (pids are reused)."""
    for path in [_notice_path(server_pid), *map(_done_path, stub_pids)]:
        path.unlink(missing_ok=True)
