"""Swap the tokenizer live through Triton's repository API: no failed request, llm untouched."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from client.admin import ADMIN_HEADER, swap_tokenizer
from launcher.paths import CACHE_DIR
from ipc.stubs import stubs

PIRATE = "You are a pirate captain. Answer every question like a pirate."


def preprocess_text(http_url: str, tokenizer, text: str) -> str:
    reply = requests.post(f"{http_url}/v2/models/preprocess/generate", json={"text_input": text}, timeout=60)
    assert reply.status_code == 200, reply.text
    return tokenizer.decode(reply.json()["input_ids"])


def input_ids(http_url: str, text: str) -> list[int]:
    reply = requests.post(f"{http_url}/v2/models/preprocess/generate", json={"text_input": text}, timeout=60)
    return reply.json()["input_ids"]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


class Traffic:
    """Closed-loop requests from a few threads, recording every non-200 answer."""

    def __init__(self, generate, threads: int = 4) -> None:
        self.generate, self.failures, self.done = generate, [], 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop) for _ in range(threads)]

    def loop(self) -> None:
        while not self.stop.is_set():
            reply = self.generate({"text_input": "Name a colour.", "max_tokens": 4})
            if reply.status_code != 200:
                self.failures.append(reply.text)
            self.done += 1

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


@pytest.fixture
def restore_tokenizer(server, grpc_url, model_dir):
    yield
    swap_tokenizer(grpc_url, str(model_dir), ("preprocess", "postprocess"), server.admin_key)


def test_new_chat_template_takes_over_under_traffic_without_reloading_llm(
    server, http_url, grpc_url, generate, tokenizer, tokenizer_copy, restore_tokenizer
):
    pirate = tokenizer_copy("pirate")
    template = pirate / "chat_template.jinja"
    template.write_text(template.read_text().replace(
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face", PIRATE))
    assert PIRATE not in preprocess_text(http_url, tokenizer, "Hi")
    llm_pids, llm_loads = stubs(server.process.pid).get("llm"), server.loads("llm")
    ask = {"text_input": "Which sea is the saltiest, and why? Answer in a sentence.", "max_tokens": 2}
    before = [generate(ask).json() for _ in range(2)]
    assert before[1]["cached_tokens"] > 0  # the default template's prompt is in the prefix cache
    old_ids = input_ids(http_url, ask["text_input"])
    assert llm_pids

    with Traffic(generate) as traffic:
        wait_for(lambda: traffic.done >= 4)  # traffic flows before the swap
        swap_tokenizer(grpc_url, str(pirate), admin_key=server.admin_key)
        served_at_swap = traffic.done
        wait_for(lambda: traffic.done >= served_at_swap + 4)  # and after it

    assert traffic.failures == [] and traffic.done > served_at_swap > 0
    assert PIRATE in preprocess_text(http_url, tokenizer, "Hi")
    assert stubs(server.process.pid).get("llm") == llm_pids and server.loads("llm") == llm_loads
    # The prefix cache is keyed by token ids: the new template's prompt reuses only the full blocks of ids it
    # shares with a prompt seen before, the old template's or the traffic's under the new one.
    new_ids = input_ids(http_url, ask["text_input"])
    shared = max(common_prefix(new_ids, seen) for seen in (old_ids, input_ids(http_url, "Name a colour.")))
    assert generate(ask).json()["cached_tokens"] == min(shared, len(new_ids) - 1) // 16 * 16 < before[1]["cached_tokens"]


def test_tokenizer_with_another_vocabulary_gets_clear_errors(server, grpc_url, generate, tokenizer_copy, restore_tokenizer):
    from transformers import AutoTokenizer

    bigger = tokenizer_copy("bigger")
    extended = AutoTokenizer.from_pretrained(bigger)
    extended.add_tokens([f"<extra_{i}>" for i in range(8)])
    extended.save_pretrained(bigger)

    swap_tokenizer(grpc_url, str(bigger), ("postprocess",), server.admin_key)  # llm's vocabulary no longer matches postprocess
    reply = generate({"text_input": "Hi", "max_tokens": 4})
    assert reply.status_code == 400 and "does not match postprocess's tokenizer" in reply.json()["error"]

    swap_tokenizer(grpc_url, str(bigger), admin_key=server.admin_key)  # preprocess too: its ids are not the llm model's
    reply = generate({"text_input": "Hi", "max_tokens": 4})
    assert reply.status_code == 400 and "does not match the llm model's vocabulary" in reply.json()["error"]


def test_swapping_to_a_folder_without_a_tokenizer_keeps_the_old_one(server, grpc_url, generate, tmp_path, restore_tokenizer):
    with pytest.raises(RuntimeError, match="holds no Hugging Face tokenizer"):
        swap_tokenizer(grpc_url, str(tmp_path), admin_key=server.admin_key)
    assert generate({"text_input": "Hi", "max_tokens": 4}).status_code == 200


def polled(http_url: str, load, connections: int = 8) -> tuple[float, list[float]]:
    """Run ``load`` while ``connections`` HTTP connections poll ``/v2/health/ready``: how long it took, and
    the longest each connection went unanswered during it."""
    stop, finished = threading.Event(), [[] for _ in range(connections)]

    def poll(connection: int) -> None:
        with requests.Session() as session:
            while not stop.is_set():
                assert session.get(f"{http_url}/v2/health/ready", timeout=120).status_code == 200
                finished[connection].append(time.monotonic())
                time.sleep(0.02)

    pollers = [threading.Thread(target=poll, args=(i,)) for i in range(connections)]
    for t in pollers:
        t.start()
    try:
        time.sleep(0.5)
        start = time.monotonic()
        load()
        end = time.monotonic()
    finally:
        stop.set()
        for t in pollers:
            t.join()

    def longest_wait(times: list[float]) -> float:
        during = [start, *(t for t in times if start < t < end), end]
        return max(b - a for a, b in zip(during, during[1:]))

    return end - start, [longest_wait(times) for times in finished]


def test_a_swap_holds_up_no_http_connection(server, http_url, grpc_url, tokenizer_copy, restore_tokenizer):
    """A load over HTTP holds up Triton 2.51's HTTP front end (measured here, not asserted: it is Triton's
    doing); over gRPC, no connection may wait half the load. Figures go to .cache/swap.json."""
    config = requests.get(f"{http_url}/v2/models/preprocess/config", timeout=30).json()
    config["parameters"]["tokenizer_dir"] = {"string_value": str(tokenizer_copy("over-http"))}

    def load_over_http() -> None:
        reply = requests.post(f"{http_url}/v2/repository/models/preprocess/load", headers={ADMIN_HEADER: server.admin_key},
                              json={"parameters": {"config": json.dumps(config)}}, timeout=600)
        assert reply.status_code == 200, reply.text

    http_seconds, http_waits = polled(http_url, load_over_http)
    seconds, waits = polled(http_url, lambda: swap_tokenizer(grpc_url, str(tokenizer_copy("over-grpc")),
                                                           admin_key=server.admin_key))
    figures = {"connections": len(waits),
               "http": {"load_s": round(http_seconds, 2), "longest_waits_s": sorted(round(w, 2) for w in http_waits)},
               "grpc": {"load_s": round(seconds, 2), "longest_waits_s": sorted(round(w, 2) for w in waits)}}
    (CACHE_DIR / "swap.json").write_text(json.dumps(figures, indent=2))
    assert max(waits) < seconds / 2, figures
