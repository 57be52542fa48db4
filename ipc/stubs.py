"""Which Python stub processes run, read from /proc: the only sign Triton 2.51 gives that a stub died.

Measured on Triton 2.51: when a model's stub is killed (OOM killer, segfault), health and model readiness
keep answering 200, and the requests a decoupled model's stub held are never answered (python_backend
restarts a dead stub, and fails its requests, only for models that are not decoupled). Nor does Triton
reap the killed process: it stays a zombie, while a stub that exits normally (an unload, the short-lived
stub of every load) is reaped at once. So a model that Triton calls ready with no stub process is dead,
and the watchdog reloads it; a stub turned zombie died, and ensemble_infer answers the requests it
stranded, even after the watchdog has brought the model back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path

STUB = b"triton_python_backend_stub"


def stubs(server_pid: int | None = None) -> dict[str, set[int]]:
    """PIDs of the Python stubs of each model (of one tritonserver, or of any)."""
    found: dict[str, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():  # /proc/self is the caller, a stub itself when ensemble_infer looks
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The stub's arguments: model.py path, shm region, sizes, the parent tritonserver's pid, ...
        if len(args) > 5 and args[0].endswith(STUB) and (server_pid is None or args[5] == str(server_pid).encode()):
            model = Path(args[1].decode()).parent.parent.name
            found.setdefault(model, set()).add(int(proc.name))
    return found


def dead_models(models: Iterable[str], is_ready: Callable[[str], bool], server_pid: int | None = None) -> set[str]:
    """Those of ``models`` that are ready by Triton's account with no stub left.

    An unloaded model is not ready, and a reload keeps the old stub until the new one runs. The second
    look at /proc drops a model whose load finished between the first look and the readiness check.
    """
    missing = set(models) - set(stubs(server_pid))
    if not missing:
        return set()
    ready = {m for m in missing if is_ready(m)}
    return ready - set(stubs(server_pid)) if ready else set()


START_TIME = 19  # the index in ``stat``'s fields of the start time, which tells a process from a later one with its pid


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after "(comm)" (the state first, the start time at START_TIME), or None once
    the process was reaped (or never was)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def zombies(pids: Iterable[int]) -> set[int]:
    """Those of ``pids`` that exited and were never reaped."""
    return {pid for pid in pids if (fields := stat(pid)) and fields[0] == "Z"}


class DeathWatch:
    """Reports, once each, the stubs of ``models`` that died: seen alive, then a zombie in two looks in a
    row (the second look rules out the instant between a normal exit and its reaping).

    A stub leaves ``stubs`` as soon as its exit begins (its command line goes with its memory) but turns
    zombie only once its memory is freed: 0.34 s for a 3 GiB process on the AMD EPYC. A look in between
    must not take it for a normal exit, so a stub is forgotten only once it is reaped (its pid gone, or
    another process's: the start time differs)."""

    def __init__(self, models: Collection[str], server_pid: int | None = None) -> None:
        self.models, self.server_pid = set(models), server_pid
        self.alive: dict[int, tuple[str, str]] = {}  # pid -> (model, start time), seen alive, not yet forgotten
        self.suspects: set[int] = set()
        # A first look now: a stub killed before the first periodic one would never have been seen alive
        # (CI: the OpenAI front end's first look came a second after it was ready, the kill before it).
        self.look()

    def look(self) -> set[str]:
        """The models that lost a stub since the look before last; call it every second or so."""
        running = stubs(self.server_pid)
        live = {pid: model for model in self.models for pid in running.get(model, ())}
        for pid, model in live.items():
            if pid not in self.alive and (fields := stat(pid)):
                self.alive[pid] = (model, fields[START_TIME])
        gone = {pid: stat(pid) for pid in set(self.alive) - set(live)}
        reaped = {pid for pid, fields in gone.items() if fields is None or fields[START_TIME] != self.alive[pid][1]}
        zombie = {pid for pid, fields in gone.items() if pid not in reaped and fields[0] == "Z"}
        dead, self.suspects = zombie & self.suspects, zombie - self.suspects
        died = {self.alive[pid][0] for pid in dead}
        for pid in dead | reaped:  # reported now, or reaped (a normal exit); an exit under way is looked at again
            del self.alive[pid]
        return died
