"""A bounded soak above capacity: every accepted request gets exactly its own complete answer.

SOAK_SECONDS (default 60 in CI; raise it for a long soak) of closed-loop traffic from SOAK_CONCURRENCY
(80, above llm's 64 running rows) clients mixing HTTP generate, HTTP streaming (a fifth cancelled after
the first chunk), KServe infer with an id and gRPC streaming with a request id, greedy and seeded
sampling. The figures go to .cache/soak.json.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import requests
import tritonclient.grpc as grpcclient

from client import ChatClient, Prompt, build_inputs
from conftest import metric_value
from launcher.paths import CACHE_DIR

SECONDS = float(os.environ.get("SOAK_SECONDS", "60"))
CONCURRENCY = int(os.environ.get("SOAK_CONCURRENCY", "80"))
QUESTIONS = ["Name a colour.", "What is 2 + 3?", "Say hello in French.", "Name a planet.", "写一个字。", "Give me an emoji."]
PROMPTS = [Prompt(q, max_tokens=12) for q in QUESTIONS] + [Prompt(q, max_tokens=12, temperature=0.8, seed=i)
                                                           for i, q in enumerate(QUESTIONS)]


@dataclass
class Outcome:
    kind: str
    prompt: int
    text: str | None = None  # None: cancelled by the client on purpose
    echoed_id: bool = True
    error: str | None = None


def server_rss(pid: int) -> int:
    """tritonserver and its Python stubs, in bytes."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def http_generate(url: str, n: int) -> Outcome:
    reply = requests.post(f"{url}/v2/models/ensemble/generate", json=PROMPTS[n].body(), timeout=300)
    data = reply.json()
    return Outcome("generate", n, data.get("text_output"), error=data.get("error"))


def http_stream(url: str, n: int, cancel: bool) -> Outcome:
    chat = ChatClient(url.removeprefix("http://"), "http", timeout=300)
    parts = []
    try:
        for chunk in chat.stream(PROMPTS[n]):  # leaving the loop closes the connection: the server cancels
            parts.append(chunk.text_output)
            if cancel:
                return Outcome("stream cancelled", n)
        return Outcome("stream", n, "".join(parts))
    finally:
        chat.close()


def http_infer(url: str, n: int) -> Outcome:
    prompt, request_id = PROMPTS[n], uuid.uuid4().hex
    inputs = [{"name": name, "shape": [1, 1], "datatype": datatype, "data": [getattr(prompt, name)]}
              for name, datatype in (("text_input", "BYTES"), ("max_tokens", "INT32"), ("temperature", "FP32"),
                                     ("seed", "INT64")) if getattr(prompt, name) is not None]
    reply = requests.post(f"{url}/v2/models/ensemble_infer/infer", json={"id": request_id, "inputs": inputs}, timeout=300)
    data = reply.json()
    if "error" in data:
        return Outcome("infer", n, error=data["error"])
    text = next(o["data"][0] for o in data["outputs"] if o["name"] == "text_output")
    return Outcome("infer", n, text, echoed_id=data.get("id") == request_id)


def grpc_stream(address: str, n: int) -> Outcome:
    client, answers, request_id = grpcclient.InferenceServerClient(address), [], uuid.uuid4().hex
    done = threading.Event()

    def callback(result, error) -> None:
        answers.append((result, error))
        if error is not None or result.as_numpy("finish_reason")[0][0]:
            done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("ensemble", build_inputs(grpcclient, PROMPTS[n], stream=True), request_id=request_id)
        assert done.wait(300), "no final response"
    finally:
        client.stop_stream()
        client.close()
    errors = [e for _, e in answers if e is not None]
    if errors:
        return Outcome("grpc stream", n, error=str(errors[0]))
    text = "".join(r.as_numpy("text_output")[0][0].decode() for r, _ in answers)
    return Outcome("grpc stream", n, text, echoed_id=all(r.get_response().id == request_id for r, _ in answers))


def test_soak_above_capacity_loses_nothing_and_mixes_nothing_up(server):
    """In float32 activations, where a greedy reply does not depend on its batch-mates (conftest.server)."""
    http_url = server.url

    def llm_metric(name: str) -> float:
        return metric_value(server, name)

    grpc_address = f"127.0.0.1:{server.ports.grpc}"
    expected = [http_generate(http_url, n).text for n in range(len(PROMPTS))]  # each prompt alone
    assert all(expected)
    rss = [server_rss(server.process.pid)]
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + SECONDS

    def client(seed: int) -> int:
        """Closed loop until the deadline; returns how many requests it sent."""
        rng, sent = random.Random(seed), 0
        while time.monotonic() < deadline:
            n, kind = rng.randrange(len(PROMPTS)), rng.randrange(4)
            sent += 1
            if kind == 0:
                outcomes.append(http_generate(http_url, n))
            elif kind == 1:
                outcomes.append(http_stream(http_url, n, cancel=rng.random() < 0.2))
            elif kind == 2:
                outcomes.append(http_infer(http_url, n))
            else:
                outcomes.append(grpc_stream(grpc_address, n))
        return sent

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        clients = [pool.submit(client, seed) for seed in range(CONCURRENCY)]
        while not all(c.done() for c in clients):
            rss.append(server_rss(server.process.pid))
            time.sleep(1)
        submitted = sum(c.result() for c in clients)
    settle = time.monotonic() + 30
    while llm_metric("llm_requests_running") + llm_metric("llm_requests_waiting") > 0 and time.monotonic() < settle:
        time.sleep(0.5)
    rss.append(server_rss(server.process.pid))

    answered = [o for o in outcomes if o.kind != "stream cancelled"]
    figures = {
        "seconds": SECONDS, "concurrency": CONCURRENCY, "requests": len(outcomes),
        "cancelled": len(outcomes) - len(answered), "errors": sum(o.error is not None for o in answered),
        "kinds": {k: sum(o.kind == k for o in outcomes) for k in sorted({o.kind for o in outcomes})},
        "rss_mib": {"start": rss[0] / 2**20, "peak": max(rss) / 2**20, "end": rss[-1] / 2**20},
    }
    (CACHE_DIR / "soak.json").write_text(json.dumps(figures, indent=2))
    assert len(outcomes) == submitted and figures["cancelled"] > 0 and len(answered) > CONCURRENCY
    assert [o for o in answered if o.error] == []
    assert [o for o in answered if o.text != expected[o.prompt] or not o.echoed_id] == []
    assert llm_metric("llm_requests_running") == llm_metric("llm_requests_waiting") == 0
    assert rss[-1] - rss[0] < 512 * 2**20, figures["rss_mib"]  # bounded: no growth with requests served
