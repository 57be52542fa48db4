"""Stopping a real server: cancellation leaks nothing, and SIGTERM drains before it stops.

Each test runs servers of its own, because each ends by stopping them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import tritonclient.grpc as grpcclient

from client import ChatClient, Prompt, build_inputs
from conftest import metric_value, running_frontend, running_server
from launcher.paths import REPO_ROOT
from launcher.process import EXIT_AFTER_DRAIN, Ports, wait_healthy

STORY = "Tell me a long story about a lighthouse keeper and the sea."
STOP_SECONDS = 5.0  # SIGTERM to exit, with nothing in flight
LEAK_LINES = ("Exit timeout expired", "Non-graceful termination")


def stop_is_clean(server, started: float) -> float:
    """Seconds from ``started`` until ``server`` stopped; asserts Triton found nothing in flight."""
    server.stop()
    seconds = time.monotonic() - started
    log = server.log_path.read_text(errors="replace")
    assert "Found 0 model versions that have in-flight inferences" in log
    assert not any(line in log for line in LEAK_LINES), server.log_tail(30)
    assert not [line for line in log.splitlines() if "has " in line and "in-flight inferences" in line]
    return seconds


def cancel_http(url: str, after_chunks: int) -> None:
    with requests.post(f"{url}/v2/models/ensemble/generate_stream", stream=True, timeout=60,
                       json={"text_input": STORY, "max_tokens": 200, "ignore_eos": True, "stream": True}) as reply:
        lines = reply.iter_lines()
        for _ in range(after_chunks):
            next(line for line in lines if line)


def cancel_grpc(url: str, after_seconds: float, prompt: str = STORY) -> None:
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer("ensemble", build_inputs(grpcclient, Prompt(prompt, 200, ignore_eos=True), stream=True))
    time.sleep(after_seconds)
    client.stop_stream(cancel_requests=True)
    client.close()


def test_cancelled_requests_leave_nothing_in_flight_and_sigterm_stops_at_once(model_dir, tmp_path_factory):
    """Cancelled at every stage, over every API: before the first step ends (a long prompt still being
    tokenized or prefilled), queued behind it, mid-generation, and at the last token (the final step in
    postprocess); then Triton's own count at SIGTERM is 0 and it stops at once. Triton 2.51's ensemble
    kept every such request in flight, and SIGTERM waited out its whole 30 s exit timeout."""
    servers = running_server(model_dir, tmp_path_factory)
    server = next(servers)
    frontends = running_frontend(server, model_dir, tmp_path_factory)
    frontend = next(frontends)
    long_prompt = " ".join(["The keeper climbed the stairs and lit the lamp."] * 150)  # about 1500 tokens
    client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=60)
    cancels = [
        lambda: cancel_grpc(server.grpc_url, 0.0, long_prompt),  # in preprocess or prefill, nothing sent yet
        lambda: cancel_grpc(server.grpc_url, 0.05),
        lambda: cancel_grpc(server.grpc_url, 0.4),
        lambda: cancel_http(server.url, 1),
        lambda: cancel_http(server.url, 5),
    ]
    threads = [threading.Thread(target=c) for c in cancels]  # together: some queue behind the long prompt
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for chunks in (1, 3):  # the OpenAI API: a client that stops reading, and one past its deadline
        stream = client.chat.completions.create(model=frontend.model_name, stream=True, max_tokens=200,
                                                messages=[{"role": "user", "content": STORY}], extra_body={"ignore_eos": True})
        for _, _ in zip(range(chunks), stream):
            pass
        stream.close()
    with pytest.raises(openai.APIStatusError) as timed_out:
        client.with_options(timeout=60).chat.completions.create(
            model=frontend.model_name, max_tokens=300, messages=[{"role": "user", "content": STORY}],
            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Timeout": "0.5"})
    assert timed_out.value.status_code == 504
    # The last token: a generation whose final chunk is cancelled in postprocess.
    for max_tokens in (1, 2, 3):
        with requests.post(f"{server.url}/v2/models/ensemble/generate_stream", stream=True, timeout=60,
                           json={"text_input": STORY, "max_tokens": max_tokens, "stream": True}):
            pass  # closed before reading: cancelled while its last responses are on their way
    deadline = time.monotonic() + 30
    while metric_value(server, "llm_requests_running") + metric_value(server, "llm_requests_waiting") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric_value(server, "llm_requests_running") == metric_value(server, "llm_requests_waiting") == 0
    stats = requests.get(f"{server.url}/v2/models/stats", timeout=10).json()["model_stats"]
    assert all(requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).text.count(
        f'nv_inference_pending_request_count{{model="{m["name"]}",version="1"}} 0') == 1 for m in stats)
    # A reply after all that is whole.
    assert ChatClient(f"127.0.0.1:{server.ports.http}").generate(Prompt("Hi", 8)).completion_tokens > 0
    next(frontends, None)  # the front end first, as the launcher stops them
    assert stop_is_clean(server, time.monotonic()) < STOP_SECONDS
    next(servers, None)


def sse_events(reply: requests.Response, begun: threading.Event | None = None) -> list:
    """Every ``data:`` event of a stream until it ends, ``[DONE]`` included; ``begun`` is set at the first."""
    events = []
    for line in reply.iter_lines():
        if line.startswith(b"data: "):
            events.append(line[len(b"data: "):].decode())
            if begun is not None:
                begun.set()
    return events


def test_sigterm_drains_finishes_short_streams_and_ends_long_ones_with_an_error(model_dir, tmp_path):
    """``python -m launcher serve`` (make serve) with DRAIN_TIMEOUT=5, streams running on both APIs, then
    SIGTERM: new requests are refused (503 and Retry-After on the OpenAI API; Triton's UNAVAILABLE, which
    its generate endpoint reports as 400), health says not ready, short streams finish, long ones end
    with an error event and [DONE], and everything has exited within the drain timeout and a few
    seconds."""
    drain = 5
    ports = Ports.free()
    # Long streams that outlast the drain on any machine: 4000 tokens (MAX_TOKENS_LIMIT raised for them).
    env = {**os.environ, "MODEL_DIR": str(model_dir), "DRAIN_TIMEOUT": str(drain), "MAX_TOKENS_LIMIT": "4000",
           "HTTP_PORT": str(ports.http),
           "GRPC_PORT": str(ports.grpc), "METRICS_PORT": str(ports.metrics), "OPENAI_PORT": str(ports.openai)}
    log = tmp_path / "serve.log"
    launcher = subprocess.Popen([sys.executable, "-m", "launcher", "serve"], cwd=REPO_ROOT, env=env,
                                stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url, openai_url = f"http://127.0.0.1:{ports.http}", f"http://127.0.0.1:{ports.openai}"
    try:
        wait_healthy(f"{openai_url}/health", launcher, "make serve", 600)
        deadline = time.monotonic() + 10
        while "ready: Triton" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = log.read_text().splitlines()
        ready_lines = [line for line in lines if "ready: Triton" in line]
        assert len(ready_lines) == 1 and f"/v1 (model '{model_dir.name}')" in ready_lines[0], log.read_text()[-2000:]
        # The front end says it answers only once Triton does (its first line says it waits).
        said = [i for i, line in enumerate(lines) if "OpenAI API ready" in line or "successfully loaded 'ensemble'" in line]
        assert len(said) == 2 and "successfully loaded 'ensemble'" in lines[said[0]], [lines[i] for i in said]
        results: dict[str, object] = {}
        begun = {name: threading.Event() for name in ("openai short", "triton short")}

        def openai_stream(name: str, max_tokens: int) -> None:
            body = {"model": model_dir.name, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": STORY}]}
            with requests.post(f"{openai_url}/v1/chat/completions", json=body, stream=True, timeout=120) as reply:
                results[name] = sse_events(reply, begun.get(name))

        def triton_stream(name: str, max_tokens: int) -> None:
            client = ChatClient(f"127.0.0.1:{ports.grpc}", "grpc", timeout=120)
            try:
                count = 0
                for _ in client.stream(Prompt(STORY, max_tokens, ignore_eos=True)):
                    count += 1
                    if name in begun:
                        begun[name].set()
                results[name] = count
            except Exception as e:  # noqa: BLE001 - the error is what is checked
                results[name] = e
            finally:
                client.close()

        long = [threading.Thread(target=openai_stream, args=("openai long", 4000)),
                threading.Thread(target=triton_stream, args=("triton long", 4000))]
        short = [threading.Thread(target=openai_stream, args=("openai short", 32)),
                 threading.Thread(target=triton_stream, args=("triton short", 32))]
        for t in long:
            t.start()
        time.sleep(1)
        for t in short:
            t.start()
        for event in begun.values():  # the short ones have begun (taken before the drain), and are not done
            assert event.wait(60)
        started = time.monotonic()
        os.killpg(launcher.pid, signal.SIGTERM)
        time.sleep(1)
        refused = requests.post(f"{openai_url}/v1/chat/completions", timeout=30, json={
            "model": model_dir.name, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert "stopping" in refused.json()["error"]["message"]
        assert requests.get(f"{openai_url}/health", timeout=10).status_code == 503
        triton_refused = requests.post(f"{url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 4},
                                       timeout=30)
        assert triton_refused.status_code == 400 and "unavailable: the server is stopping" in triton_refused.json()["error"]
        health = subprocess.run([sys.executable, "-m", "launcher", "health"], cwd=REPO_ROOT, env=env, timeout=30)
        assert health.returncode == 1
        for t in long + short:
            t.join(timeout=drain + 30)
        launcher.wait(timeout=drain + 30)
        stopped = time.monotonic() - started
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    short = results["openai short"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    cut = results["openai long"]
    assert cut[-1] == "[DONE]" and "drain timeout" in json.loads(cut[-2])["error"]["message"], cut[-3:]
    assert isinstance(results["triton short"], int) and results["triton short"] > 1, str(results["triton short"])  # ended by its finish_reason
    assert "drain timeout" in str(results["triton long"])
    assert stopped < drain + EXIT_AFTER_DRAIN, stopped
    text = log.read_text(errors="replace")
    assert "drained" in text and "Traceback" not in text, text[-3000:]
    # The front end refused until Triton had stopped, and only then left.
    assert text.index("tritonserver stopped") < text.index("openai_frontend: drained: stopping"), text[-3000:]
    assert not any(line in text for line in LEAK_LINES), text[-3000:]
    (Path(tmp_path) / "stop.json").write_text(json.dumps({"drain_timeout": drain, "stopped_s": stopped}))
