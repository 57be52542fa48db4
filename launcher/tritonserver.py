"""One real ``tritonserver``: its command line, start, readiness and stop (a drain first)."""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.admin import ADMIN_HEADER, GRPC_ADMIN_HEADER
from launcher.child import owned
from launcher.install import has_gpu, install_tritonserver, server_env
from launcher.paths import MODEL_REPOSITORY
from launcher.process import DRAIN_SLACK, Ports, answers, drain_timeout, port_is_free, stop_group, wait_healthy
from launcher.watchdog import Watchdog, python_models
from ipc import drain_notice, stubs

log = logging.getLogger(__name__)

# The APIs that change the server (load and unload models, even upload their files; register shared
# memory; change logging and tracing) answer only requests with the header ``admin-key: $ADMIN_KEY``.
# Inference, health, metadata, model configs and statistics stay open.
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"

# Threads of the Python backend beside each model instance (2.51's default is 32). Each BLS call to
# ensemble holds one until its answer comes, so ensemble_infer's max_in_flight needs as many, and a call
# stranded by a dead stub holds its thread for good: with the default, 40 infer requests in flight at a
# kill left ensemble_infer unable to answer anything, their guard's errors included (measured).
PYTHON_BACKEND_THREADS = 512
# Without a GPU: no pinned or CUDA memory pools and no GPU metrics, which only log warnings there. Two
# error lines remain that no flag silences, both harmless on a CPU (docs/operations.md).
CPU_ONLY_FLAGS = ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false"]


def admin_key() -> str:
    """``ADMIN_KEY`` from the environment; without it a random key nobody knows, so the restricted APIs
    stay shut rather than open."""
    return os.environ.get("ADMIN_KEY") or secrets.token_urlsafe(32)


class StartUpLines:
    """llm's start-up progress (llm/compiles.py's ``Progress``) from a tritonserver log, logged here as it grows."""

    LINE = re.compile(r'\] "(llm: start-up [^"]*)"')

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0  # a restart's log goes on from here

    def show(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                text = f.read()
        except OSError:
            return
        text = text[:text.rfind(b"\n") + 1]  # whole lines only
        self.offset += len(text)
        for found in self.LINE.finditer(text.decode(errors="replace")):
            log.info("%s", found.group(1))


@dataclass
class TritonServer:
    """One tritonserver process on ``ensemble_repo/`` in explicit model control mode.

    Explicit mode with ``--load-model=*`` loads everything at start and lets operators reload one model
    (for example ``preprocess`` with a new tokenizer) through the repository API without touching ``llm``;
    that API needs ``admin_key`` (``RESTRICTED_APIS``).
    """

    ports: Ports = field(default_factory=Ports.from_env)
    model_repository: Path = MODEL_REPOSITORY
    model_env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    model_config_name: str | None = None
    extra_args: list[str] = field(default_factory=list)
    admin_key: str = field(default_factory=admin_key, repr=False)
    process: subprocess.Popen | None = None
    watchdog: Watchdog | None = None  # runs with the process: Triton 2.51 misses a dead Python stub
    _drain_notes: list[int] = field(default_factory=list, repr=False)  # llm stubs whose drain notes to clear
    start_up: StartUpLines | None = field(default=None, repr=False)  # llm's progress lines, from the log file

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def command(self) -> list[str]:
        home = install_tritonserver()
        config_name = self.model_config_name
        if config_name is None:
            config_name = "" if has_gpu() else "cpu"
        cmd = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            f"--cache-directory={home / 'caches'}",
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--http-port={self.ports.http}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            "--exit-timeout-secs=30",
            f"--backend-config=python,thread-pool-size={PYTHON_BACKEND_THREADS}",
            f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
        ]
        if config_name:
            cmd.append(f"--model-config-name={config_name}")
        if config_name == "cpu":
            cmd += CPU_ONLY_FLAGS
        return cmd + self.extra_args

    def start(self) -> "TritonServer":
        """Start the process (again, after it ended: launcher/supervisor.py); refuse ports already taken, so
        we never talk to someone else's server."""
        for name, port in (("HTTP_PORT", self.ports.http), ("GRPC_PORT", self.ports.grpc), ("METRICS_PORT", self.ports.metrics)):
            if not port_is_free(port):
                raise RuntimeError(f"port {port} ({name}) is already in use; stop that server or set {name}")
        out = open(self.log_path, "ab" if self.process else "wb") if self.log_path else None  # a restart appends
        self.start_up = StartUpLines(self.log_path) if self.log_path else None
        if self.watchdog:  # a restart's: the old one watched the process that ended
            self.watchdog.stop()
        self.process = subprocess.Popen(
            owned(self.command()), env=server_env(self.model_env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.watchdog = Watchdog(self.url, self.grpc_url, self.admin_key, python_models(self.model_repository),
                                 self.process.pid).start()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until ``/v2/health/ready`` answers 200; raises when the process dies or the deadline passes. With
        a log file (``make run``), llm's start-up lines are shown as they come: a first start compiles for
        minutes, which would otherwise be silence after "starting tritonserver"."""
        shown = self.start_up
        wait_healthy(f"{self.url}/v2/health/ready", self.process, "tritonserver", timeout, self.log_hint(),
                     on_poll=shown.show if shown else lambda: None)
        if shown:
            shown.show()

    def ready(self) -> bool:
        """One look at ``/v2/health/ready`` (the supervisor's, which must not block on one child), showing
        llm's start-up lines that came meanwhile."""
        if self.start_up:
            self.start_up.show()
        return answers(f"{self.url}/v2/health/ready")

    def log_hint(self) -> str:
        return f"see the server log at {self.log_path}" if self.log_path else "see the output above"

    def log_tail(self, lines: int = 80) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def loads(self, model: str) -> int:
        """How often ``model`` loaded so far, by the log (tests tell a reload from none with it)."""
        return self.log_path.read_text(errors="replace").count(f"successfully loaded '{model}'")

    def drain(self, seconds: float, hurry: threading.Event | None = None) -> bool:
        """Refuse new requests and let the ones held finish, for up to ``seconds`` (or until ``hurry`` is
        set), after which llm ends the rest with an error (``ipc/drain_notice.py``); True once every llm
        instance holds nothing."""
        pid = self.process.pid
        llm_stubs = self._drain_notes = sorted(stubs.stubs(pid).get("llm", ()))
        drain_notice.begin(pid, seconds)
        deadline, cut = time.monotonic() + seconds + DRAIN_SLACK, False
        while self.process.poll() is None and time.monotonic() < deadline:
            if drain_notice.drained(llm_stubs):
                return not cut
            if hurry is not None and hurry.is_set() and not cut:  # llm ends what it holds at once
                log.warning("ending the requests in flight now")
                drain_notice.begin(pid, 0)
                deadline, cut = time.monotonic() + DRAIN_SLACK, True
            time.sleep(0.1)
        return False

    def unload_models(self) -> None:
        """Unload every model before the SIGTERM. On SIGTERM Triton 2.51 first waits, up to its whole exit
        timeout, for clients to close their idle keep-alive HTTP connections, and only then unloads: a
        client that keeps one open made every stop take 30 s and end with "Exit timeout expired" (measured).
        Unloaded first, every stub exits cleanly, and ``stop_group`` ends the wait once none is left."""
        headers = {GRPC_ADMIN_HEADER: self.admin_key}
        try:
            client = grpcclient.InferenceServerClient(self.grpc_url)
            try:
                for model in client.get_model_repository_index(headers=headers, as_json=True).get("models", []):
                    if model.get("state") == "READY":
                        client.unload_model(model["name"], headers=headers)
            finally:
                client.close()
        except InferenceServerException as e:  # the SIGTERM still stops it, only less quickly
            log.warning("could not unload the models before stopping: %s", e)

    def stop(self, timeout: float = 40.0, drain_seconds: float | None = None, hurry: threading.Event | None = None) -> None:
        """Drain (up to ``drain_seconds``, default ``DRAIN_TIMEOUT``, or until ``hurry`` is set), then
        SIGTERM: Triton unloads every model and exits. SIGKILL past ``timeout`` after the SIGTERM.

        Triton 2.51 counts a model whose load failed (a tokenizer swap to a bad folder) as live until its
        whole ``--exit-timeout-secs`` runs out, then exits with "Exit timeout expired"; it also waits that
        long for clients to close idle keep-alive HTTP connections. Once every Python stub has exited,
        every request was answered and every model unloaded, so past a short grace the launcher ends the
        process itself instead of waiting out those 30 s.
        """
        if self.watchdog:
            self.watchdog.stop()
        if not self.process:
            return
        if self.process.poll() is not None:
            self.end_orphaned_stubs()
            return
        pid, started = self.process.pid, time.monotonic()
        seconds = drain_timeout() if drain_seconds is None else drain_seconds
        drained = self.drain(seconds, hurry)
        log.info("tritonserver %s in %.1f s; stopping it", "drained" if drained else "did not drain",
                 time.monotonic() - started)
        self.unload_models()
        if stop_group(self.process, timeout, settled=lambda: not stubs.stubs(pid)):
            log.info("every model is unloaded; ended tritonserver (Triton 2.51 would wait out its exit timeout "
                     "for idle keep-alive HTTP connections, or for a model whose load failed)")
        drain_notice.clear(pid, self._drain_notes)
        log.info("tritonserver stopped %.1f s after the stop began", time.monotonic() - started)

    def end_orphaned_stubs(self) -> None:
        """SIGKILL the Python stubs of a tritonserver that died without unloading its models (Triton 2.51
        aborts on a shared-memory lock a killed stub held, docs/operations.md#faults): they outlive it,
        llm's holding the model's memory, and would run on unseen. Found by the server pid each stub's
        command line names, so no other process is touched whoever has that pid now."""
        orphans = stubs.stubs(self.process.pid)
        for pid in sorted(p for pids in orphans.values() for p in pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited meanwhile
                pass
        deadline = time.monotonic() + 10
        while orphans and stubs.stubs(self.process.pid) and time.monotonic() < deadline:  # dying takes a moment
            time.sleep(0.05)
        if orphans:
            log.warning("tritonserver exited with code %s and left the Python stubs of %s running: killed them",
                        self.process.returncode, ", ".join(sorted(orphans)))

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
