"""``make serve`` as an operator meets it when things go wrong: ready only when a request would be served,
children that never outlive the launcher however it ends (signals repeated, SIGKILL), and a tritonserver
or a front end that dies started again, with a metric, until a restart limit says to give up. Each test
runs ``python -m launcher serve`` on free ports, as ``make serve`` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from launcher.paths import CACHE_DIR, REPO_ROOT
from launcher.process import Ports, port_is_free
from ipc import stubs

ASK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


class Serve:
    """``python -m launcher serve`` on free ports, its output in ``log``; ``marker``, an environment
    variable every process it starts inherits, finds them (tritonserver, its stubs, the front end)."""

    def __init__(self, model_dir: Path, log: Path, **env: str) -> None:
        self.ports, self.log, self.model = Ports.free(), log, model_dir.name
        self.marker = f"SERVE_TEST_MARKER={uuid.uuid4().hex}"
        env = {**os.environ, "HTTP_PORT": str(self.ports.http), "GRPC_PORT": str(self.ports.grpc),
               "METRICS_PORT": str(self.ports.metrics), "OPENAI_PORT": str(self.ports.openai),
               "MODEL_DIR": str(model_dir), "DRAIN_TIMEOUT": "30", **dict([self.marker.split("=")]), **env}
        self.process = subprocess.Popen([sys.executable, "-m", "launcher", "serve"], cwd=REPO_ROOT, env=env,
                                        stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self.triton = f"http://127.0.0.1:{self.ports.http}"
        self.openai = f"http://127.0.0.1:{self.ports.openai}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def state(self) -> dict:
        return json.loads((CACHE_DIR / "run" / f"launcher-{self.process.pid}.json").read_text())

    def chat(self) -> int | None:
        """A chat request's status, or None when nothing listens."""
        try:
            return requests.post(f"{self.openai}/v1/chat/completions", json={"model": self.model, **ASK}, timeout=120).status_code
        except requests.ConnectionError:
            return None

    def serving(self) -> None:
        """Until the launcher has said everything answers."""
        self.wait(lambda: "ready: Triton" in self.output(), "the launcher's ready line", 600)

    def wait(self, check, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what} within {timeout:g} s\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def children(self, command: str = "") -> list[int]:
        """The processes the launcher started, and theirs (those whose command line holds ``command``)."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == self.process.pid:
                continue
            try:
                environ, cmdline = (proc / "environ").read_bytes(), (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if self.marker.encode() in environ.split(b"\0") and command.encode() in cmdline:
                found.append(int(proc.name))
        return found

    def gone(self, timeout: float = 60) -> None:
        """Every port free and no process of this server left: its tritonserver, stubs, front end."""
        def nothing_left() -> bool:
            ports = (self.ports.http, self.ports.grpc, self.ports.metrics, self.ports.openai)
            return all(map(port_is_free, ports)) and not self.children()
        self.wait(nothing_left, "every child ended and every port free", timeout)


def status(url: str) -> int | None:
    try:
        reply = requests.get(url, timeout=5)
    except requests.RequestException:
        return None
    if reply.status_code == 503:
        assert reply.headers.get("Retry-After"), reply.headers  # a 503 always says when to retry
    return reply.status_code


@pytest.fixture
def serve(model_dir, tmp_path):
    started: list[Serve] = []

    def start(**env: str) -> Serve:
        started.append(Serve(model_dir, tmp_path / f"serve{len(started)}.log", **env))
        return started[-1]

    yield start
    for s in started:
        if s.process.poll() is None:
            s.process.kill()
        for pid in s.children():
            os.kill(pid, signal.SIGKILL)
        (CACHE_DIR / "run" / f"launcher-{s.process.pid}.json").unlink(missing_ok=True)  # a killed launcher's


def test_ready_means_a_request_is_served_and_repeated_signals_still_end_every_child(serve):
    s = serve(MAX_TOKENS_LIMIT="4000")  # a reply that outlasts DRAIN_TIMEOUT (30 s) on any machine
    seen = {"triton": set(), "openai": set()}
    s.wait(lambda: seen["triton"].add(status(f"{s.triton}/v2/health/ready")) or 200 in seen["triton"], "Triton ready", 600)
    reply = requests.post(f"{s.triton}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2}, timeout=120)
    assert reply.status_code == 200, reply.text  # sent the instant Triton first said ready
    s.wait(lambda: seen["openai"].add(status(f"{s.openai}/v1/models")) or 200 in seen["openai"], "/v1/models 200", 120)
    assert s.chat() == 200  # sent the instant /v1/models first said 200
    assert seen["openai"] <= {None, 503, 200}, seen  # before: nothing listening, or 503 with Retry-After
    assert "ready: Triton" in s.output()
    # Ctrl-C, then two SIGTERMs (make forwards one more): the second is logged, the third ends the drain
    # of a long reply now; the launcher leaves cleanly and nothing it started is left.
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(requests.post, f"{s.triton}/v2/models/ensemble/generate", timeout=120,
                           json={"text_input": "Tell me a story.", "max_tokens": 4000, "ignore_eos": True})
        time.sleep(2)
        started = time.monotonic()
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGTERM):
            s.process.send_signal(number)
            time.sleep(0.5)
        assert s.process.wait(timeout=60) == 0
        assert time.monotonic() - started < 25  # well before DRAIN_TIMEOUT's 30 s: the third signal cut it
        assert long.result().status_code != 200  # the reply the cut drain ended, with an error
    output = s.output()
    assert "already stopping" in output and "ending the drain now" in output and "Traceback" not in output
    s.gone()


def test_children_end_when_the_launcher_is_killed(serve):
    s = serve()
    s.serving()
    s.process.kill()  # no stop, no drain: the parent-death signal is all that is left (launcher/child.py)
    s.process.wait()
    s.gone(timeout=90)


def test_a_dead_tritonserver_or_front_end_is_started_again_until_the_restart_limit(serve):
    s = serve(RESTART_LIMIT="1", RESTART_WINDOW="600")
    s.serving()
    first = s.state()["triton_pid"]
    os.kill(first, signal.SIGKILL)
    answered = set()
    s.wait(lambda: answered.add(s.chat()) or 200 in answered, "chat served again", 600)
    assert 503 in answered  # meanwhile the front end said to retry (with Retry-After), it did not go away
    assert s.state()["triton_pid"] != first and not stubs.stubs(first)  # started again, its old stubs ended
    assert "tritonserver ended unexpectedly (killed by SIGKILL)" in s.output()
    # the front end may reach the new tritonserver before the launcher's next look at it (POLL_SECONDS)
    s.wait(lambda: "tritonserver is serving again" in s.output(), "the launcher's serving-again line", 60)
    metrics = requests.get(f"{s.openai}/metrics", timeout=10).text
    assert 'launcher_restarts_total{process="tritonserver"} 1.0' in metrics
    [frontend] = s.children("openai_frontend")
    os.kill(frontend, signal.SIGKILL)
    s.wait(lambda: s.chat() == 200, "the front end back", 120)
    assert 'launcher_restarts_total{process="openai_frontend"} 1.0' in requests.get(f"{s.openai}/metrics", timeout=10).text
    os.kill(s.state()["triton_pid"], signal.SIGKILL)  # past RESTART_LIMIT: the launcher gives up, and says why
    assert s.process.wait(timeout=120) == 1
    assert "tritonserver ended (killed by SIGKILL) after 1 restarts within 600 s (RESTART_LIMIT, RESTART_WINDOW): " \
           "giving up" in s.output()
    s.gone()
