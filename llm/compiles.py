"""What torch compiles in this process, and what the engine says while it compiles at load.

``COMPILATIONS`` counts every compilation event torch announces through dynamo's callback hooks: a frame
traced and compiled (or loaded from the inductor cache), and any compile torch defers to run time
(CUDA-graph recording by ``reduce-overhead``, a lazy backward, runtime autotuning). The engine does all
of that at load; a count that grows after ready means a request waited on the compiler, which is what
``llm_compilations_total`` and ``make gpu-check`` watch for.

``Progress`` keeps a start-up that takes minutes from looking hung: it logs each phase as it begins and,
while one lasts, what it is doing and for how long, every ``every`` seconds.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def __call__(self, *_args) -> None:  # dynamo passes CallbackArgs (trigger, compile id) in newer releases
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count


COMPILATIONS = _Counter()
torch._dynamo.callback_handler.register_start_callback(COMPILATIONS)


class Progress:
    """Start-up log lines with elapsed time: one per phase, and a heartbeat while a phase lasts."""

    def __init__(self, log: Callable[[str], None], every: float = 10.0) -> None:
        self.log = log
        self.every = every
        self.began = time.perf_counter()
        self._doing = "loading"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="llm-startup-log", daemon=True)
        self._thread.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def phase(self, text: str) -> None:
        """A new phase: logged now, and repeated by the heartbeat while it lasts."""
        self._doing = text
        self.log(f"llm: start-up {self.elapsed():.1f} s: {text}")

    def status(self, text: str) -> None:
        """Where the current phase is (one shape of many): the heartbeat's next line says it."""
        self._doing = text

    def close(self, text: str) -> None:
        self._done.set()
        self._thread.join()
        self.log(f"llm: start-up {self.elapsed():.1f} s: {text}")

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            self.log(f"llm: start-up {self.elapsed():.1f} s: still {self._doing}")
