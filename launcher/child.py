"""``python -m launcher.child PARENT COMMAND...``: run COMMAND so that it ends when the launcher does.

Why: tritonserver and the front end run in process groups of their own (so a Ctrl-C at the terminal
reaches only the launcher, which drains them in order), so nothing ends them if the launcher dies without
stopping them (SIGKILL, an OOM kill, a crash): they would keep the ports and the model's memory. Linux's
parent-death signal closes that gap: set here, kept across ``exec``, it sends COMMAND a SIGTERM (its own
graceful stop) when the launcher's thread that started it ends. PARENT is the launcher's pid: had it died
before the signal was set, this exits instead of starting an orphan.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent:
        print(f"launcher.child: the launcher ({parent}) is gone; not starting {command[0]}", file=sys.stderr)
        return 1
    os.execvp(command[0], command)
    return 1  # unreachable: execvp replaces this process or raises


def owned(command: list[str]) -> list[str]:
    """``command`` as the launcher starts it: ending when the calling process does (see the module)."""
    return [sys.executable, "-m", "launcher.child", str(os.getpid()), *command]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
