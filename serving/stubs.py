"""Which Python stub processes run, read from /proc: the only sign Triton 2.51 gives that a stub died.

Measured on Triton 2.51: when a model's stub is killed (OOM killer, segfault), health and model readiness
keep answering 200, and the requests a decoupled model's stub held are never answered (python_backend
restarts a dead stub, and fails its requests, only for models that are not decoupled). A model that
Triton calls ready but that has no stub process is therefore dead. The watchdog reloads it; ensemble_infer
answers the requests it stranded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
