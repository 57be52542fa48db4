"""Notice a Python stub process that died, and bring its model back.

Triton 2.51 does not notice a dead stub (``ipc/stubs.py`` has what it does instead) and never
restarts one of a decoupled model. A plain load with the same config is a no-op; unload then load starts
a fresh stub (about 15 s for llm on 2 cores). This watchdog does that, and ``healthy`` tells the truth
that ``/v2/health/ready`` does not.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import requests

from client.admin import reload_with_config
from ipc import stubs

log = logging.getLogger(__name__)


def python_models(repository: Path) -> set[str]:
    return {p.parent.parent.name for p in repository.glob("*/1/model.py")}


def dead_models_at(url: str, models: set[str], server_pid: int | None = None) -> set[str]:
    """Ready by Triton's account (an open API: no admin key needed), with no stub left."""
    return stubs.dead_models(models, lambda m: requests.get(f"{url}/v2/models/{m}/ready", timeout=10).status_code == 200,
                             server_pid)


def healthy(url: str, models: set[str], server_pid: int | None = None) -> bool:
    """``/v2/health/ready``, and no ready Python model without its stub: the truth 2.51 does not tell."""
    try:
        return requests.get(f"{url}/v2/health/ready", timeout=5).status_code == 200 and \
            not dead_models_at(url, models, server_pid)
    except requests.RequestException:
        return False


class Watchdog:
    """A thread that checks every ``interval`` seconds and reloads a model whose stubs died."""

    def __init__(self, url: str, grpc_url: str, admin_key: str, models: set[str], server_pid: int | None = None,
                 interval: float = 2.0) -> None:
        self.url, self.grpc_url, self.admin_key = url, grpc_url, admin_key
        self.models, self.server_pid = models, server_pid
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
        """Unload, then load with the config it was serving (a swapped tokenizer stays swapped), over gRPC
        so that the load does not hold up HTTP clients (``client/admin.py``)."""
        log.error("watchdog: the Python stub of '%s' died; unloading and loading it again", model)
        reload_with_config(self.grpc_url, model, lambda config: None, "the config it was serving", self.admin_key,
                           unload_first=True)
        self.recoveries.append(model)
        log.warning("watchdog: '%s' is back", model)

    def run(self) -> None:
        """The checking loop, until ``stop`` (in this thread: ``python -m launcher watch``)."""
        while not self._stop.wait(self.interval):
            try:
                for model in sorted(dead_models_at(self.url, self.models, self.server_pid)):
                    self.recover(model)
            except requests.ConnectionError as e:  # the server is starting or stopping
                log.debug("watchdog: %s", e)
            except (requests.RequestException, RuntimeError) as e:
                log.warning("watchdog: %s (will retry)", e)
