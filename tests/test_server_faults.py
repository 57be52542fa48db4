"""Kill llm's Python stub mid-traffic: clear errors meanwhile, and the watchdog brings llm back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from launcher.watchdog import healthy, python_models, stubs


def test_a_killed_llm_stub_is_replaced_and_service_resumes(server, http_url):
    (victim,) = stubs(server.process.pid)["llm"]
    body = {"text_input": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}

    def in_flight() -> str:
        try:
            reply = requests.post(f"{http_url}/v2/models/ensemble/generate", json=body, timeout=30)
            return f"{reply.status_code} {reply.text}"
        except requests.Timeout:
            return "client timeout"  # Triton 2.51 never answers requests held by a dead stub

    with ThreadPoolExecutor(2) as pool:
        lost = pool.submit(in_flight)
        time.sleep(2)
        os.kill(victim, signal.SIGKILL)
        outage, deadline = [], time.monotonic() + 180
        while True:  # until llm answers again: every reply meanwhile is a clear error, none hangs
            reply = requests.post(f"{http_url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2}, timeout=60)
            if reply.status_code == 200:
                break
            outage.append(reply.json()["error"])
            assert time.monotonic() < deadline, outage[-3:]
            time.sleep(0.5)
        assert not lost.result().startswith("200")
    assert server.watchdog.recoveries == ["llm"]
    assert stubs(server.process.pid)["llm"] != {victim}
    # Before the watchdog acts: the dead stub; while it reloads llm: the ensemble has no version.
    clear = ("Stub process 'llm_0_0' is not healthy", "'ensemble' has no available versions")
    assert outage and all(any(c in e for c in clear) for e in outage), set(outage)
    assert healthy(http_url, python_models(server.model_repository), server.process.pid)
    check = subprocess.run([sys.executable, "-m", "launcher", "health"], env={**os.environ, "HTTP_PORT": str(server.ports.http)},
                           timeout=60)
    assert check.returncode == 0
