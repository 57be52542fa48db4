"""Start and stop the OpenAI-compatible front end (``python -m openai_frontend``) beside a tritonserver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launcher.child import owned
from launcher.paths import REPO_ROOT
from launcher.process import DRAIN_SLACK, answers, drain_timeout, port_is_free, stop_group, wait_healthy
from launcher.tritonserver import TritonServer


@dataclass
class OpenAIFrontend:
    """One front end process for ``triton``, on ``triton.ports.openai``; ``env`` adds settings such as
    ``API_KEYS`` or ``OPENAI_REQUEST_TIMEOUT`` (see ``openai_frontend/__main__.py``)."""

    triton: TritonServer
    model_name: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = 0  # 0: the server's ports.openai
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = self.port or self.triton.ports.openai

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OpenAIFrontend":
        if not port_is_free(self.port):
            raise RuntimeError(f"port {self.port} (OPENAI_PORT) is already in use; stop that server or set OPENAI_PORT")
        env = {**os.environ, "TRITON_GRPC_URL": self.triton.grpc_url, "OPENAI_PORT": str(self.port),
               "OPENAI_MODEL_NAME": self.model_name, "TRITON_PID": str(self.triton.process.pid),
               # The folder llm reads (a GGUF file's prepared one): its config.json says the context /tokenize reports.
               **{k: v for k, v in self.triton.model_env.items() if k == "MODEL_DIR"}, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
        out = open(self.log_path, "wb") if self.log_path else None
        self.process = subprocess.Popen(owned([sys.executable, "-m", "openai_frontend"]), env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until ``/health`` answers 200 (it does once Triton is ready)."""
        wait_healthy(f"{self.url}/health", self.process, f"the OpenAI front end on :{self.port}", timeout)

    def ready(self) -> bool:
        """One look at ``/health``."""
        return answers(f"{self.url}/health")

    def drain(self) -> None:
        """SIGUSR1: the front end refuses new requests (503) and lets its streams go on, without exiting
        (``openai_frontend/shutdown.py``), while Triton drains beside it."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGUSR1)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM: it exits once its last stream has ended (its own drain, begun or not: once Triton has
        stopped, every stream has had its end). Past ``timeout`` (its drain's, and a margin), SIGKILL."""
        stop_group(self.process, drain_timeout() + 2 * DRAIN_SLACK if timeout is None else timeout)

    def __enter__(self) -> "OpenAIFrontend":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
