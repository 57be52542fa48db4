"""Notice a Python stub process that died, and bring its model back.

Measured on Triton 2.51: when a model's stub is killed (OOM killer, segfault), Triton does not notice.
Health and model readiness keep answering 200, new requests fail at once with "Stub process '<model>_0_0'
is not healthy.", requests that were in flight never get an answer (only the client's timeout ends
them), and Triton never restarts the stub by itself. A plain load with the same config is a no-op;
unload then load starts a fresh stub (about 15 s for llm on 2 cores). This watchdog does that, and
``healthy`` tells the truth that ``/v2/health/ready`` does not.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import requests

from client.admin import ADMIN_HEADER

log = logging.getLogger(__name__)

STUB = b"triton_python_backend_stub"


def python_models(repository: Path) -> set[str]:
    return {p.parent.parent.name for p in repository.glob("*/1/model.py")}


def stubs(server_pid: int | None = None) -> dict[str, set[int]]:
    """PIDs of the Python stubs of each model (of one tritonserver, or of any)."""
    found: dict[str, set[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The stub's arguments: model.py path, shm region, sizes, the parent tritonserver's pid, ...
        if len(args) > 5 and args[0].endswith(STUB) and (server_pid is None or args[5] == str(server_pid).encode()):
            model = Path(args[1].decode()).parent.parent.name
            found.setdefault(model, set()).add(int(proc.name))
    return found


def ready_models(url: str, models: set[str]) -> set[str]:
    """Those of ``models`` that Triton calls ready (an open API: no admin key needed)."""
    return {m for m in models if requests.get(f"{url}/v2/models/{m}/ready", timeout=10).status_code == 200}


def dead_models(url: str, models: set[str], server_pid: int | None = None) -> set[str]:
    """Ready by Triton's account, with no stub left. An operator's unload is not ready; a reload keeps
    the old stub until the new one runs."""
    return ready_models(url, models) - set(stubs(server_pid))


def healthy(url: str, models: set[str], server_pid: int | None = None) -> bool:
    """``/v2/health/ready``, and no ready Python model without its stub: the truth 2.51 does not tell."""
    try:
        return requests.get(f"{url}/v2/health/ready", timeout=5).status_code == 200 and \
            not dead_models(url, models, server_pid)
    except requests.RequestException:
        return False


class Watchdog:
    """A thread that checks every ``interval`` seconds and reloads a model whose stubs died."""

    def __init__(self, url: str, admin_key: str, models: set[str], server_pid: int | None = None,
                 interval: float = 2.0) -> None:
        self.url, self.admin_key, self.models, self.server_pid = url, admin_key, models, server_pid
        self.interval = interval
        self.recoveries: list[str] = []  # models brought back, in order (operators read it in the log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="triton-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def recover(self, model: str) -> None:
        """Unload, then load with the config it was serving (a swapped tokenizer stays swapped)."""
        headers = {ADMIN_HEADER: self.admin_key}
        log.error("watchdog: the Python stub of '%s' died; unloading and loading it again", model)
        config = requests.get(f"{self.url}/v2/models/{model}/config", timeout=30)
        config.raise_for_status()
        requests.post(f"{self.url}/v2/repository/models/{model}/unload", headers=headers, timeout=300).raise_for_status()
        requests.post(f"{self.url}/v2/repository/models/{model}/load", headers=headers, timeout=600,
                      json={"parameters": {"config": config.text}}).raise_for_status()
        self.recoveries.append(model)
        log.warning("watchdog: '%s' is back", model)

    def run(self) -> None:
        """The checking loop, until ``stop`` (in this thread: ``python -m launcher watch``)."""
        while not self._stop.wait(self.interval):
            try:
                for model in sorted(dead_models(self.url, self.models, self.server_pid)):
                    self.recover(model)
            except requests.ConnectionError as e:  # the server is starting or stopping
                log.debug("watchdog: %s", e)
            except requests.RequestException as e:
                log.warning("watchdog: %s (will retry)", e)
