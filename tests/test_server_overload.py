"""A burst far above capacity: every request gets a full answer or a fast, clear refusal."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client import Prompt, build_inputs
from client.admin import reload_with_config

# Two rows bind before the KV budget does; the budget itself is kept, since another kv_cache_tokens means
# other cache buffers and so a compile of llm's forward pass (minutes on a fresh machine).
LIMITS = {"max_running_requests": 2, "max_queued_requests": 2, "max_queue_seconds": 3}
LONG, SHORT = 160, 24


@pytest.fixture
def tight_llm(server, http_url, grpc_url):
    """``llm`` reloaded with a tiny budget and queue, then restored as it was."""
    served = requests.get(f"{http_url}/v2/models/llm/config", timeout=30).json()

    def tighten(config: dict) -> None:
        for key, value in LIMITS.items():
            config["parameters"][key]["string_value"] = str(value)

    reload_with_config(grpc_url, "llm", tighten, "tight limits", server.admin_key)
    yield
    reload_with_config(grpc_url, "llm", lambda config: config.update(served), "its own config", server.admin_key)


def test_a_burst_above_capacity_is_answered_or_refused_never_lost(server, http_url, llm_metric, tight_llm):
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    body = {"text_input": "Tell me a long story.", "ignore_eos": True}

    def generate(max_tokens: int) -> tuple[str, int, str, float]:
        reply = requests.post(f"{http_url}/v2/models/ensemble/generate", json={**body, "max_tokens": max_tokens}, timeout=120)
        data = reply.json()
        return "generate", reply.status_code, data.get("error") or str(data["completion_tokens"]), time.monotonic()

    def infer(max_tokens: int) -> tuple[str, int, str, float]:
        request = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [body["text_input"]]},
                              {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [max_tokens]},
                              {"name": "ignore_eos", "shape": [1, 1], "datatype": "BOOL", "data": [True]}]}
        reply = requests.post(f"{http_url}/v2/models/ensemble_infer/infer", json=request, timeout=120)
        data = reply.json()
        if "error" in data:
            return "infer", reply.status_code, data["error"], time.monotonic()
        tokens = next(o["data"][0] for o in data["outputs"] if o["name"] == "completion_tokens")
        return "infer", reply.status_code, str(tokens), time.monotonic()

    def grpc_infer(max_tokens: int) -> tuple[str, object, str, float]:
        try:
            result = grpc.infer("ensemble_infer", build_inputs(grpcclient, Prompt(body["text_input"], max_tokens, ignore_eos=True)),
                                client_timeout=120)
            return "grpc", "OK", str(result.as_numpy("completion_tokens")[0][0]), time.monotonic()
        except InferenceServerException as e:
            return "grpc", e.status(), e.message(), time.monotonic()

    refused_before = llm_metric("llm_requests_rejected_total")
    with ThreadPoolExecutor(32) as pool:
        long = [pool.submit(generate, LONG) for _ in range(LIMITS["max_running_requests"])]
        deadline = time.monotonic() + 60
        while llm_metric("llm_requests_running") < LIMITS["max_running_requests"]:
            assert time.monotonic() < deadline, "the long requests never started"
            time.sleep(0.2)
        burst = [pool.submit(call, SHORT) for _ in range(8) for call in (generate, infer, grpc_infer)]
        burst = [f.result() for f in burst]
        long = [f.result() for f in long]
    grpc.close()

    # A refusal is fast and says why, with the code each protocol has for "try later".
    codes = {"generate": 400, "infer": 503, "grpc": "StatusCode.UNAVAILABLE"}  # generate: 2.51 reports any error as 400
    answered = [r for r in burst if r[1] in (200, "OK")]
    refused = [r for r in burst if r not in answered]
    assert all(r[2] == str(SHORT) for r in answered) and all(r[2] == str(LONG) and r[1] == 200 for r in long)
    assert refused and all(r[1] == codes[r[0]] and "overloaded: " in r[2] for r in refused), refused
    at_once = [r for r in refused if "already waiting" in r[2]]
    waited = [r for r in refused if "max_queue_seconds=3" in r[2]]
    assert at_once and waited and len(at_once) + len(waited) == len(refused)
    assert max(r[3] for r in at_once) < min(r[3] for r in long)  # not held until capacity frees up
    assert llm_metric("llm_requests_rejected_total") - refused_before == len(refused)
    assert llm_metric("llm_requests_waiting") == 0
