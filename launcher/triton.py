"""Start and stop a real ``tritonserver`` from the ``nvidia-pytriton`` wheel.

The wheel ships Triton 2.51 (the NGC 24.10 binary) with the Python backend and one backend stub per
Python version. We copy the tree once into ``.cache/tritonserver``, put the stub that matches this
interpreter into ``backends/python/``, and point the stub at the same libpython as the venv (otherwise it
fails with ``undefined symbol: _PyModule_Add``).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.admin import ADMIN_HEADER, GRPC_ADMIN_HEADER
from launcher.watchdog import Watchdog, python_models
from triton_glue import drain, stubs

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "ensemble_repo"
CACHE_DIR = Path(os.environ.get("CHAT_CACHE_DIR", REPO_ROOT / ".cache"))
TRITON_HOME = CACHE_DIR / "tritonserver"
# llm's compiled forward pass: inductor's code and Triton's GPU kernels, compiled by the first start and
# loaded by every later one. The image keeps the same folder (/opt/chat/cache/compile) in a volume.
COMPILE_CACHE = CACHE_DIR / "compile"

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
SETTLED_GRACE = 3.0  # seconds a stopping process gets to exit on its own once it is settled (stop_group)
# Seconds a stopping server lets the requests it holds finish before it ends them with an error
# (DRAIN_TIMEOUT); compose's stop_grace_period and Kubernetes' terminationGracePeriodSeconds leave room for it.
DEFAULT_DRAIN_TIMEOUT = 30.0
DRAIN_SLACK = 5.0  # past the drain timeout, for the errors that end what was left to reach their clients
# After a drain, unloading and exiting (SETTLED_GRACE included); measured under 6 s on 2 cores.
EXIT_AFTER_DRAIN = 10.0


def drain_timeout() -> float:
    """``DRAIN_TIMEOUT`` seconds from the environment (default 30; 0 ends what is running at once)."""
    raw = os.environ.get("DRAIN_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_DRAIN_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise RuntimeError(f"DRAIN_TIMEOUT must be a number of seconds >= 0, got {raw!r}")
    return seconds


def repository_variant(target: Path, edit_llm_config: Callable[[str], str], llm_model: Path | None = None) -> Path:
    """``ensemble_repo`` at ``target`` with llm's configs (GPU and CPU) edited and, if given, its ``model.py``
    replaced; every other model is a symlink to the original (benchmarks and tests run such variants)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for model in MODEL_REPOSITORY.iterdir():
        if model.is_dir() and model.name != "llm":
            (target / model.name).symlink_to(model)
    llm = target / "llm"
    (llm / "configs").mkdir(parents=True)
    for config in ("config.pbtxt", "configs/cpu.pbtxt"):
        (llm / config).write_text(edit_llm_config((MODEL_REPOSITORY / "llm" / config).read_text()))
    if llm_model is None:
        (llm / "1").symlink_to(MODEL_REPOSITORY / "llm" / "1")
    else:
        (llm / "1").mkdir()
        shutil.copy2(llm_model, llm / "1" / "model.py")
    return target


def admin_key() -> str:
    """``ADMIN_KEY`` from the environment; without it a random key nobody knows, so the restricted APIs
    stay shut rather than open."""
    return os.environ.get("ADMIN_KEY") or secrets.token_urlsafe(32)


def _wheel_tree() -> tuple[Path, Path]:
    """The wheel's ``tritonserver`` folder and its bundled shared libraries."""
    import pytriton

    site = Path(pytriton.__file__).resolve().parents[1]
    return site / "pytriton" / "tritonserver", site / "nvidia_pytriton.libs"


def install_tritonserver() -> Path:
    """Copy the wheel's server tree out once and add this Python's backend stub; idempotent."""
    stamp = TRITON_HOME / ".python-stub"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if stamp.exists() and stamp.read_text() == version:
        return TRITON_HOME
    tree, _ = _wheel_tree()
    stub = tree / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    shutil.rmtree(TRITON_HOME, ignore_errors=True)
    shutil.copytree(tree, TRITON_HOME, symlinks=True)
    shutil.copy2(stub, TRITON_HOME / "backends" / "python" / stub.name)
    stamp.write_text(version)
    return TRITON_HOME


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs: same libpython, venv first, project importable."""
    _, libs = _wheel_tree()
    env = dict(os.environ)
    ld_path = [sysconfig.get_config_var("LIBDIR"), str(libs)]
    if env.get("LD_LIBRARY_PATH"):
        ld_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld_path)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(COMPILE_CACHE / "triton"))
    env.update(extra or {})
    env.pop("ADMIN_KEY", None)  # it reaches tritonserver as an argument; the models have no use for it
    if "MODEL_DIR" in env:  # contract/paths.py: models and tokenizers load only from inside MODEL_ROOTS
        env.setdefault("MODEL_ROOTS", str(Path(env["MODEL_DIR"]).resolve().parent))
    return env


def stop_group(process: subprocess.Popen | None, timeout: float, settled: Callable[[], bool] | None = None) -> bool:
    """SIGTERM a process started with ``start_new_session`` and its children, SIGKILL past ``timeout``, or
    sooner once ``settled()`` (it has nothing left to finish) has held for ``SETTLED_GRACE`` seconds
    without the process exiting. True when it was ended for that."""
    if not process or process.poll() is not None:
        return False
    os.killpg(process.pid, signal.SIGTERM)
    deadline, settled_at, early = time.monotonic() + timeout, None, False
    while process.poll() is None and time.monotonic() < deadline and not early:
        settled_at = (settled_at or time.monotonic()) if settled and settled() else None
        early = settled_at is not None and time.monotonic() - settled_at > SETTLED_GRACE
        time.sleep(0.2)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return early


def wait_healthy(url: str, process: subprocess.Popen | None, name: str, timeout: float, hint: str = "") -> None:
    """Poll ``url`` until it answers 200; raise when ``process`` exits first or ``timeout`` passes."""
    suffix = f"; {hint}" if hint else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process and process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}{suffix}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{name} not ready after {timeout:.0f}s{suffix}")


def has_gpu() -> bool:
    """True when ``nvidia-smi`` lists at least one GPU; Triton's KIND_GPU fails to load without one."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    openai: int = 9000  # the OpenAI-compatible front end (launcher/frontend.py)

    @classmethod
    def from_env(cls) -> "Ports":
        return cls(
            int(os.environ.get("HTTP_PORT", 8000)),
            int(os.environ.get("GRPC_PORT", 8001)),
            int(os.environ.get("METRICS_PORT", 8002)),
            int(os.environ.get("OPENAI_PORT", 9000)),
        )

    @classmethod
    def free(cls) -> "Ports":
        return cls(free_port(), free_port(), free_port(), free_port())


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
        """Start the process; refuse ports already taken, so we never talk to someone else's server."""
        for name, port in (("HTTP_PORT", self.ports.http), ("GRPC_PORT", self.ports.grpc), ("METRICS_PORT", self.ports.metrics)):
            if not port_is_free(port):
                raise RuntimeError(f"port {port} ({name}) is already in use; stop that server or set {name}")
        out = open(self.log_path, "wb") if self.log_path else None
        self.process = subprocess.Popen(
            self.command(), env=server_env(self.model_env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.watchdog = Watchdog(self.url, self.grpc_url, self.admin_key, python_models(self.model_repository),
                                 self.process.pid).start()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until ``/v2/health/ready`` answers 200; raises when the process dies or the deadline passes."""
        wait_healthy(f"{self.url}/v2/health/ready", self.process, "tritonserver", timeout, self.log_hint())

    def log_hint(self) -> str:
        return f"see the server log at {self.log_path}" if self.log_path else "see the output above"

    def log_tail(self, lines: int = 80) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def loads(self, model: str) -> int:
        """How often ``model`` loaded so far, by the log (tests tell a reload from none with it)."""
        return self.log_path.read_text(errors="replace").count(f"successfully loaded '{model}'")

    def drain(self, seconds: float) -> bool:
        """Refuse new requests and let the ones held finish, for up to ``seconds``, after which llm ends the
        rest with an error (``triton_glue/drain.py``); True once every llm instance holds nothing."""
        pid = self.process.pid
        llm_stubs = sorted(stubs.stubs(pid).get("llm", ()))
        drain.begin(pid, seconds)
        deadline = time.monotonic() + seconds + DRAIN_SLACK
        try:
            while self.process.poll() is None and time.monotonic() < deadline:
                if drain.drained(llm_stubs):
                    return True
                time.sleep(0.1)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now
            log.warning("interrupted again: stopping without waiting for the requests in flight")
        finally:
            self._drain_notes = llm_stubs
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

    def stop(self, timeout: float = 40.0, drain_seconds: float | None = None) -> None:
        """Drain (up to ``drain_seconds``, default ``DRAIN_TIMEOUT``), then SIGTERM: Triton unloads every
        model and exits. SIGKILL past ``timeout`` after the SIGTERM.

        Triton 2.51 counts a model whose load failed (a tokenizer swap to a bad folder) as live until its
        whole ``--exit-timeout-secs`` runs out, then exits with "Exit timeout expired"; it also waits that
        long for clients to close idle keep-alive HTTP connections. Once every Python stub has exited,
        every request was answered and every model unloaded, so past a short grace the launcher ends the
        process itself instead of waiting out those 30 s.
        """
        if self.watchdog:
            self.watchdog.stop()
        if not self.process or self.process.poll() is not None:
            return
        pid, started = self.process.pid, time.monotonic()
        seconds = drain_timeout() if drain_seconds is None else drain_seconds
        drained = self.drain(seconds)
        log.info("tritonserver %s in %.1f s; stopping it", "drained" if drained else "did not drain",
                 time.monotonic() - started)
        self.unload_models()
        if stop_group(self.process, timeout, settled=lambda: not stubs.stubs(pid)):
            log.info("every model is unloaded; ended tritonserver (Triton 2.51 would wait out its exit timeout "
                     "for idle keep-alive HTTP connections, or for a model whose load failed)")
        drain.clear(pid, self._drain_notes)
        log.info("tritonserver stopped %.1f s after the stop began", time.monotonic() - started)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
