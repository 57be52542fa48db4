"""Streaming, per-request sampling, stop strings, cancellation and in-flight batching on a real server."""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from client import ChatClient, Prompt
from ipc import delivery
from ipc.stubs import stubs

STORY = "Tell me a short story about a lighthouse keeper."


def streamed(client: ChatClient, prompt: Prompt) -> tuple[list[str], str]:
    chunks = list(client.stream(prompt))
    assert all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason
    return [c.text_output for c in chunks], chunks[-1].finish_reason


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_streamed_chunks_add_up_to_the_whole_reply(http_client, grpc_client, protocol):
    client = http_client if protocol == "http" else grpc_client
    prompt = Prompt(STORY, 40, temperature=0.9, top_p=0.95, seed=7)
    chunks, reason = streamed(client, prompt)
    whole = http_client.generate(prompt)
    assert len(chunks) > 10 and "".join(chunks) == whole.text_output and reason == whole.finish_reason


def test_interleaved_requests_with_different_params_each_get_their_own_reply(server):
    """In float32 activations, where a greedy reply does not depend on its batch-mates (conftest.server)."""
    http_client = ChatClient(f"127.0.0.1:{server.ports.http}", "http")
    prompts = [
        Prompt(STORY, 32),
        Prompt("Name three rivers.", 24, temperature=0.8, seed=1),
        Prompt("Write a haiku about snow.", 28, temperature=1.2, top_k=20, seed=2),
        Prompt("List some colours.", 20, temperature=0.7, top_p=0.8, repetition_penalty=1.3, seed=3),
    ]
    alone = [http_client.generate(p).text_output for p in prompts]  # one at a time: no batch-mates

    def together(i: int) -> str:
        prompt = prompts[i % len(prompts)]
        protocol = "grpc" if i % 2 else "http"
        client = ChatClient(f"127.0.0.1:{getattr(server.ports, protocol)}", protocol)  # clients are not thread-safe
        try:
            return "".join(streamed(client, prompt)[0]) if i % 3 == 0 else client.generate(prompt).text_output
        finally:
            client.close()

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(together, range(8)))
    http_client.close()
    assert replies == [alone[i % len(prompts)] for i in range(8)]


def test_a_seed_repeats_and_another_seed_differs(http_client):
    replies = {http_client.generate(Prompt(STORY, 24, temperature=1.0, seed=s)).text_output for s in (11, 11, 12)}
    assert len(replies) == 2


def test_a_stop_string_ends_the_stream_and_never_leaks(http_client):
    whole = http_client.generate(Prompt(STORY, 64, ignore_eos=True)).text_output
    words = whole.split()
    stop = " " + words[len(words) // 2]  # a string the greedy reply is known to reach mid-stream
    chunks, reason = streamed(http_client, Prompt(STORY, 64, stop=[stop, "never-generated-zzz"], ignore_eos=True))
    assert reason == "stop" and "".join(chunks) == whole[: whole.index(stop)]
    assert not any(stop.strip() in c for c in chunks)
    # The last response names the stop string that ended the reply; none for a reply that ran to its length.
    assert http_client.generate(Prompt(STORY, 64, stop=["never-generated-zzz", stop], ignore_eos=True)).stop_reason == stop
    assert http_client.generate(Prompt(STORY, 4, ignore_eos=True)).stop_reason == ""


def test_chinese_and_emoji_stream_as_whole_characters(http_client, grpc_client):
    prompt = Prompt("请用中文和表情符号回答：你最喜欢什么水果？🍎🍌", 48, ignore_eos=True)
    whole = http_client.generate(prompt).text_output
    for client in (http_client, grpc_client):
        chunks, _ = streamed(client, prompt)
        assert all("\ufffd" not in c for c in chunks) and "".join(chunks) == whole
    assert any(ord(ch) > 0x2E80 for ch in whole)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_cancelled_stream_stops_generating_and_frees_its_row(http_client, grpc_client, llm_metric, protocol):
    client = http_client if protocol == "http" else grpc_client
    stream = client.stream(Prompt(STORY, 500, ignore_eos=True))
    for _ in range(3):
        next(stream)
    stream.close()  # HTTP: the connection closes; gRPC: the stream is cancelled
    deadline = time.monotonic() + 30
    while llm_metric("llm_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    settled = llm_metric("llm_generation_tokens_total")
    time.sleep(2)
    assert llm_metric("llm_requests_running") == 0
    assert llm_metric("llm_generation_tokens_total") == settled  # nothing generates for the gone client


def marks(server) -> int:
    """How many responses postprocess has reported to llm's delivery board (ipc/delivery.py: word 0)."""
    [pid] = stubs(server.process.pid)["llm"]
    return struct.unpack("<Q", (delivery.BOARDS / str(pid)).read_bytes()[:8])[0]


def test_coalesced_streams_stay_whole_and_in_order_under_load(server, http_client, llm_metric):
    """Coalescing (a stream's tokens wait while its previous response is on its way, llm/service.py):
    with many streams at once over both protocols, a slow reader and a cancelled one, every stream's
    chunks count up and add up to the same request's whole reply, and each response the ensemble
    streamed was reported to llm by postprocess, which is what its coalescing waits on."""
    prompts = [Prompt(f"{STORY} Chapter {n}.", 40, ignore_eos=True) for n in range(12)]
    before = marks(server)

    def stream(n: int) -> list:
        protocol = "grpc" if n % 2 else "http"
        with ChatClient(f"127.0.0.1:{server.ports.http if protocol == 'http' else server.ports.grpc}", protocol) as client:
            chunks = []
            for chunk in client.stream(prompts[n]):
                chunks.append(chunk)
                if n == 0:
                    time.sleep(0.05)  # a slow reader
            return chunks

    def cancelled() -> None:
        with ChatClient(f"127.0.0.1:{server.ports.http}", "http") as client:
            stream = client.stream(Prompt(STORY, 400, ignore_eos=True))
            for _ in range(3):
                next(stream)
            stream.close()

    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        gone = pool.submit(cancelled)
        streams = list(pool.map(stream, range(len(prompts))))
        gone.result()
    streamed = marks(server) - before
    for prompt, chunks in zip(prompts, streams):
        counts = [c.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 40 and chunks[-1].finish_reason == "length", counts
        assert "".join(c.text_output for c in chunks) == http_client.generate(prompt).text_output
    assert streamed >= sum(len(chunks) for chunks in streams) + 3
    deadline = time.monotonic() + 30
    while llm_metric("llm_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert llm_metric("llm_requests_running") == 0  # the cancelled one's row is free


def test_a_request_arriving_mid_generation_finishes_before_the_long_one(http_client, generate):
    events: list[str] = []
    started = threading.Event()

    def long_stream() -> None:
        for i, _ in enumerate(http_client.stream(Prompt(STORY, 160, ignore_eos=True))):
            if i == 3:
                started.set()
        events.append("long")

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(120)
    reply = generate({"text_input": "Say hi.", "max_tokens": 4})
    events.append("short")
    thread.join(300)
    assert reply.status_code == 200 and events == ["short", "long"]


def test_llm_metrics_are_on_the_metrics_port(server, generate):
    generate({"text_input": "Hi", "max_tokens": 4})
    text = requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30).text
    for name in ("llm_prompt_tokens_total", "llm_generation_tokens_total", "llm_forward_passes_total",
                 "llm_requests_running", "llm_requests_waiting", "llm_kv_cache_tokens",
                 "llm_time_to_first_token_seconds_bucket", "llm_time_per_output_token_seconds_count"):
        assert f"\n{name}{{" in text, name
