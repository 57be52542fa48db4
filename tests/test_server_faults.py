"""Kill llm's Python stub mid-traffic: clear errors meanwhile, and the watchdog brings llm back.

The figures (seconds from the kill to the infer answers, and to the first generate answered again) go to
.cache/faults.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from launcher.paths import CACHE_DIR
from launcher.watchdog import healthy, python_models
from llm.kv import BLOCK_SIZE
from triton_glue.stubs import stubs


INFER_IN_FLIGHT = 40  # more than the Python backend's default 32 threads, which they would all strand


def test_a_killed_llm_stub_is_replaced_and_service_resumes(server, http_url, llm_metric, openai_frontend, model_dir):
    (victim,) = stubs(server.process.pid)["llm"]
    planets = {"text_input": "Name the planets of the solar system in order. " * 4, "max_tokens": 2}
    replies = [requests.post(f"{http_url}/v2/models/ensemble/generate", json=planets, timeout=60).json() for _ in range(2)]
    cached, prompt_tokens = [r["cached_tokens"] for r in replies], replies[0]["prompt_tokens"]
    story = {"text_input": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}
    infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [story["text_input"]]},
                        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [200]},
                        {"name": "ignore_eos", "datatype": "BOOL", "shape": [1, 1], "data": [True]}]}

    def in_flight(path: str, body: dict) -> tuple[str, float]:
        """The reply, and when it came (``time.monotonic()``)."""
        try:
            reply = requests.post(f"{http_url}/v2/models/{path}", json=body, timeout=30)
            return f"{reply.status_code} {reply.text}", time.monotonic()
        except requests.Timeout:
            return "client timeout", time.monotonic()

    def openai_in_flight(stream: bool) -> tuple[str, float]:
        chat = {"model": model_dir.name, "messages": [{"role": "user", "content": story["text_input"]}],
                "max_tokens": 200, "ignore_eos": True, "stream": stream}
        try:
            reply = requests.post(f"{openai_frontend.url}/v1/chat/completions", json=chat, timeout=30)
            return f"{reply.status_code} {reply.text}", time.monotonic()
        except requests.Timeout:
            return "client timeout", time.monotonic()

    with ThreadPoolExecutor(3 + INFER_IN_FLIGHT) as pool:
        lost = pool.submit(in_flight, "ensemble/generate", story)
        openai_answered = [pool.submit(openai_in_flight, stream) for stream in (False, True)]
        answered = [pool.submit(in_flight, "ensemble_infer/infer", infer) for _ in range(INFER_IN_FLIGHT)]
        time.sleep(3)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        outage, deadline = [], time.monotonic() + 180
        while True:  # until llm answers again: every reply meanwhile is a clear error, none hangs
            reply = requests.post(f"{http_url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2}, timeout=60)
            if reply.status_code == 200:
                back = time.monotonic()
                break
            outage.append(reply.json()["error"])
            assert time.monotonic() < deadline, outage[-3:]
            time.sleep(0.5)
        # Triton 2.51 never answers a generate request the dead stub held; ensemble_infer's guard answers its own.
        assert lost.result()[0] == "client timeout"
        for reply, _ in (a.result() for a in answered):
            assert reply.startswith("503 ") and "stub of 'llm' died with this request in flight" in reply, reply
        # The OpenAI front end answers its own: a 503 whole, an error event when the stream had begun.
        (whole, _), (streamed, _) = (a.result() for a in openai_answered)
        assert whole.startswith("503 ") and '"code":"unavailable"' in whole and "stub of 'llm' died" in whole, whole
        assert streamed.startswith("200 ") and "stub of 'llm' died" in streamed and streamed.rstrip().endswith("data: [DONE]")
    after_kill = [at - killed for _, at in (a.result() for a in answered)]
    openai_after_kill = [at - killed for _, at in (a.result() for a in openai_answered)]
    figures = {"infer_in_flight": INFER_IN_FLIGHT, "infer_answered_after_kill_s": [round(min(after_kill), 2), round(max(after_kill), 2)],
               "openai_answered_after_kill_s": [round(min(openai_after_kill), 2), round(max(openai_after_kill), 2)],
               "generate_answered_after_kill_s": round(back - killed, 2)}
    (CACHE_DIR / "faults.json").write_text(json.dumps(figures, indent=2))
    assert llm_metric("ensemble_infer_stranded_calls_total") == INFER_IN_FLIGHT
    after = requests.post(f"{http_url}/v2/models/ensemble_infer/infer", json={"inputs": infer["inputs"][:1]}, timeout=60)
    assert after.status_code == 200, after.text  # the stranded calls left ensemble_infer threads to work with
    assert server.watchdog.recoveries == ["llm"]
    # The new stub's cache started empty: of the question's blocks the dead stub held, it finds only those
    # that requests since the reload filled too (the chat template's system prompt, which every one shares).
    again = requests.post(f"{http_url}/v2/models/ensemble/generate", json=planets, timeout=60).json()["cached_tokens"]
    assert again < cached[1] == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert stubs(server.process.pid)["llm"] != {victim}
    # Before the watchdog acts: the dead stub; while it reloads llm: the ensemble has no version.
    clear = ("Stub process 'llm_0_0' is not healthy", "'ensemble' has no available versions")
    assert outage and all(any(c in e for c in clear) for e in outage), set(outage)
    assert healthy(http_url, python_models(server.model_repository), server.process.pid)
    check = subprocess.run([sys.executable, "-m", "launcher", "health"], env={**os.environ, "HTTP_PORT": str(server.ports.http)},
                           timeout=60)
    assert check.returncode == 0
