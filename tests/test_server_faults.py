"""Kill llm's Python stub mid-traffic: clear errors meanwhile, and the watchdog brings llm back.

Each test runs its own server, never the session's: a killed stub can take tritonserver down with it.
Triton 2.51's python backend shares locks with each stub in shared memory; when the stub died holding
one, Triton's next use of it throws ``boost::interprocess::lock_exception``, uncaught, and tritonserver
aborts (measured: 1 of 16 kills here; CI's session server once). A container then restarts (compose's
``restart: unless-stopped``, Kubernetes' restart policy), and the launcher ends the stubs it left. So the
kill test tells that abort (and only that one) from a failure, and kills again on a fresh server until
Triton survives a kill, whose recovery it checks; it fails past ``ATTEMPTS`` kills.

The figures (seconds from the kill to the infer answers, and to the first generate answered again; the
kills Triton did not survive) go to .cache/faults.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from conftest import metric_value, running_frontend, running_server
from launcher.paths import CACHE_DIR
from launcher.tritonserver import TritonServer
from launcher.watchdog import healthy, python_models
from llm.kv import BLOCK_SIZE
from ipc.stubs import stubs

INFER_IN_FLIGHT = 40  # more than the Python backend's default 32 threads, which they would all strand
ATTEMPTS = 6  # kills until Triton survives one: even at 1 abort in 3 kills, 6 in a row are 0.14 %
TRITON_ABORT = "boost::interprocess::lock_exception"  # what 2.51 prints when a dead stub held a lock


@contextmanager
def own_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server and its OpenAI front end for this test alone, stopped (and its stubs ended) after it."""
    with contextmanager(running_server)(model_dir, tmp_path_factory) as server, \
            contextmanager(running_frontend)(server, model_dir, tmp_path_factory) as frontend:
        yield server, frontend


def died(server: TritonServer) -> bool:
    """Whether tritonserver is gone; a connection refused gives it a moment to finish aborting."""
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return True


def kill_mid_traffic(server: TritonServer, openai_url: str, model: str) -> dict | None:
    """SIGKILL llm's stub with a ``generate``, two OpenAI and 40 ``infer`` requests in flight; then
    ``generate`` until it answers again. What every client saw, or None when tritonserver died."""
    http_url = server.url
    story = {"text_input": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}
    infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [story["text_input"]]},
                        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [200]},
                        {"name": "ignore_eos", "datatype": "BOOL", "shape": [1, 1], "data": [True]}]}
    chat = {"model": model, "messages": [{"role": "user", "content": story["text_input"]}], "max_tokens": 200,
            "ignore_eos": True}

    began = threading.Event()  # the OpenAI stream's first chunk came: its error must come as an event

    def in_flight(url: str, body: dict) -> tuple[str, float]:
        """The reply, and when it came (``time.monotonic()``)."""
        try:
            if not body.get("stream"):
                reply = requests.post(url, json=body, timeout=30)
                return f"{reply.status_code} {reply.text}", time.monotonic()
            with requests.post(url, json=body, timeout=30, stream=True) as reply:
                text = b""
                for chunk in reply.iter_content(chunk_size=None):
                    text += chunk
                    began.set()
            return f"{reply.status_code} {text.decode()}", time.monotonic()
        except requests.Timeout:
            return "client timeout", time.monotonic()
        except requests.ConnectionError as e:  # tritonserver aborted (or a streamed read timed out)
            return f"connection error {e}", time.monotonic()

    (victim,) = stubs(server.process.pid)["llm"]
    with ThreadPoolExecutor(3 + INFER_IN_FLIGHT) as pool:
        lost = pool.submit(in_flight, f"{http_url}/v2/models/ensemble/generate", story)
        openai = [pool.submit(in_flight, f"{openai_url}/v1/chat/completions", {**chat, "stream": stream})
                  for stream in (False, True)]
        answered = [pool.submit(in_flight, f"{http_url}/v2/models/ensemble_infer/infer", infer)
                    for _ in range(INFER_IN_FLIGHT)]
        # Killed once llm holds every one of them and the stream has begun, not after a fixed wait (3 s assumed
        # both; a request still on its way would get the outage's error instead of its own, and a stream not
        # yet begun is answered 503 whole).
        deadline = time.monotonic() + 120
        while metric_value(server, "llm_requests_running") + metric_value(server, "llm_requests_waiting") < 3 + INFER_IN_FLIGHT \
                or not began.is_set():
            assert time.monotonic() < deadline, "the requests never all reached llm, or the stream never began"
            time.sleep(0.1)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        outage, deadline = [], time.monotonic() + 180
        while True:  # until llm answers again: every reply meanwhile is a clear error, none hangs
            try:
                reply = requests.post(f"{http_url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2},
                                      timeout=60)
            except requests.ConnectionError:
                if died(server):
                    break
                raise
            if reply.status_code == 200:
                back = time.monotonic()
                break
            outage.append(reply.json()["error"])
            assert time.monotonic() < deadline, outage[-3:]
            time.sleep(0.5)
        results = {"victim": victim, "killed": killed, "lost": lost.result(), "openai": [a.result() for a in openai],
                   "answered": [a.result() for a in answered], "outage": outage}
    if server.process.poll() is not None:
        return None
    return {**results, "back": back}


def test_a_killed_llm_stub_is_replaced_and_service_resumes(model_dir, tmp_path_factory):
    aborts: list[int] = []  # tritonserver's exit code at each kill it did not survive
    for _ in range(ATTEMPTS):
        with own_server(model_dir, tmp_path_factory) as (server, frontend):
            planets = {"text_input": "Name the planets of the solar system in order. " * 4, "max_tokens": 2}
            replies = [requests.post(f"{server.url}/v2/models/ensemble/generate", json=planets, timeout=60).json()
                       for _ in range(2)]
            cached, prompt_tokens = [r["cached_tokens"] for r in replies], replies[0]["prompt_tokens"]
            seen = kill_mid_traffic(server, frontend.url, model_dir.name)
            if seen is None:
                log = server.log_path.read_text(errors="replace")
                assert TRITON_ABORT in log, f"tritonserver exited with {server.process.returncode}:\n{server.log_tail()}"
                aborts.append(server.process.returncode)
                orphans = stubs(server.process.pid)
                server.stop()
                assert not stubs(server.process.pid), f"the dead server's stubs {orphans} outlived its stop"
                continue
            check_recovery(server, seen, cached, prompt_tokens, planets, aborts)
            break
    else:
        pytest.fail(f"tritonserver aborted at each of {ATTEMPTS} kills ({TRITON_ABORT}; exit codes {aborts})")


def check_recovery(server: TritonServer, seen: dict, cached: list[int], prompt_tokens: int, planets: dict,
                   aborts: list[int]) -> None:
    """Every request in flight at the kill was answered clearly (or, Triton's own, timed out), the
    watchdog reloaded llm with an empty cache, and health is true again."""
    http_url = server.url
    # Triton 2.51 never answers a generate request the dead stub held; ensemble_infer's guard answers its own.
    assert seen["lost"][0] == "client timeout", seen["lost"]
    for reply, _ in seen["answered"]:
        assert reply.startswith("503 ") and "stub of 'llm' died with this request in flight" in reply, reply
    # The OpenAI front end answers its own: a 503 whole, an error event when the stream had begun.
    (whole, _), (streamed, _) = seen["openai"]
    assert whole.startswith("503 ") and '"code":"unavailable"' in whole and "stub of 'llm' died" in whole, whole
    assert streamed.startswith("200 ") and "stub of 'llm' died" in streamed and streamed.rstrip().endswith("data: [DONE]")
    killed = seen["killed"]
    after_kill = [at - killed for _, at in seen["answered"]]
    openai_after_kill = [at - killed for _, at in seen["openai"]]
    figures = {"infer_in_flight": INFER_IN_FLIGHT, "infer_answered_after_kill_s": [round(min(after_kill), 2), round(max(after_kill), 2)],
               "openai_answered_after_kill_s": [round(min(openai_after_kill), 2), round(max(openai_after_kill), 2)],
               "generate_answered_after_kill_s": round(seen["back"] - killed, 2), "kills_triton_did_not_survive": len(aborts)}
    (CACHE_DIR / "faults.json").write_text(json.dumps(figures, indent=2))
    assert metric_value(server, "ensemble_infer_stranded_calls_total") == INFER_IN_FLIGHT
    after = requests.post(f"{http_url}/v2/models/ensemble_infer/infer", json={"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Hi"]}]}, timeout=60)
    assert after.status_code == 200, after.text  # the stranded calls left ensemble_infer threads to work with
    assert server.watchdog.recoveries == ["llm"]
    # The new stub's cache started empty: of the question's blocks the dead stub held, it finds only those
    # that requests since the reload filled too (the chat template's system prompt, which every one shares).
    again = requests.post(f"{http_url}/v2/models/ensemble/generate", json=planets, timeout=60).json()["cached_tokens"]
    assert again < cached[1] == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert stubs(server.process.pid)["llm"] != {seen["victim"]}
    # Before the watchdog acts: the dead stub; while it reloads llm: the ensemble has no version.
    clear = ("Stub process 'llm_0_0' is not healthy", "'ensemble' has no available versions")
    assert seen["outage"] and all(any(c in e for c in clear) for e in seen["outage"]), set(seen["outage"])
    assert healthy(http_url, python_models(server.model_repository), server.process.pid)
    check = subprocess.run([sys.executable, "-m", "launcher", "health"], env={**os.environ, "HTTP_PORT": str(server.ports.http)},
                           timeout=60)
    assert check.returncode == 0


def test_the_stubs_of_a_server_that_died_end_with_its_stop(model_dir, tmp_path_factory):
    """A tritonserver that dies without unloading (an abort, as above, or ``kill -9``) leaves its stubs
    running, llm's with the model's memory; ``TritonServer.stop`` (``make serve``'s exit) ends them."""
    with contextmanager(running_server)(model_dir, tmp_path_factory) as server:
        before = stubs(server.process.pid)
        assert set(before) == python_models(server.model_repository)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        assert stubs(server.process.pid) == before  # Triton's death does not end them
        server.stop()
        assert not stubs(server.process.pid)
