"""Async closed-loop load: ``concurrency`` clients, each sending its next request when the last returns.

aiohttp for HTTP and tritonclient's asyncio gRPC client, so one Python process on two cores can keep 32
requests in flight without becoming the bottleneck; the client's own CPU time is reported with every point.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from bench.workload import Item
from client import Prompt, build_inputs

MODELS = ("ensemble", "ensemble_infer", "preprocess", "llm", "postprocess")


@dataclass(frozen=True)
class Received:
    """What one request got: its generated tokens, the seconds to its first text, and when each response
    that carried text came (seconds after the request; empty where the system answers once), for the
    time between chunks and the tokens a chunk carries: what coalescing trades (issue 45)."""

    tokens: int
    ttft: float
    chunks: tuple[float, ...] = ()


Send = Callable[[Item], Awaitable[Received]]


@dataclass
class Run:
    """What one closed-loop run measured: per-request latencies, time to first token, token and chunk
    counts, the gaps between a reply's chunks, wall and client CPU."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0
    client_cpu_s: float = 0.0


async def warm_up(send: Send, items: list[Item]) -> None:
    """One round at the point's concurrency, not measured (first batches pay allocation and caching)."""
    await asyncio.gather(*(send(item) for item in items))


async def closed_loop(send: Send, items: list[Item], concurrency: int) -> Run:
    queue = list(reversed(items))
    run = Run()

    async def client() -> None:
        while queue:
            item = queue.pop()
            begin = time.perf_counter()
            reply = await send(item)
            run.latencies.append(time.perf_counter() - begin)
            run.ttfts.append(reply.ttft)
            run.tokens.append(reply.tokens)
            run.chunks.append(len(reply.chunks))
            run.gaps.extend(b - a for a, b in zip(reply.chunks, reply.chunks[1:]))

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    run.seconds, run.client_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return run


def http_stream(session: aiohttp.ClientSession, url: str, model: str = "ensemble",
                first_token_within: float | None = None) -> Send:
    """``generate_stream`` with ``stream: true``: the first event carries the first token's text (a
    server that cannot stream sends one event at the end, so its TTFT is its latency). With
    ``first_token_within``, a first event later than that many seconds raises ``TimeoutError``."""

    async def send(item: Item) -> Received:
        body = {"text_input": item.text_input, "max_tokens": item.max_tokens, "ignore_eos": item.ignore_eos,
                "stream": True}
        body |= {k: v for k, v in (("temperature", item.temperature), ("top_p", item.top_p), ("seed", item.seed))
                 if v is not None}
        if item.structured_outputs is not None:
            body["structured_outputs"] = json.dumps(item.structured_outputs)
        begin, chunks, tokens = time.perf_counter(), [], 0
        async with session.post(f"{url}/v2/models/{model}/generate_stream", json=body) as reply:
            lines = aiter(reply.content)
            while True:
                wait = None if chunks or first_token_within is None else first_token_within - (time.perf_counter() - begin)
                try:
                    line = await asyncio.wait_for(anext(lines), wait)
                except StopAsyncIteration:
                    break
                if not line.startswith(b"data: "):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"generate_stream failed: {data['error']}")
                if data["text_output"] or not chunks:
                    chunks.append(time.perf_counter() - begin)
                tokens = data["completion_tokens"]
        return Received(tokens, chunks[0], tuple(chunks))

    return send


def openai_stream(session: aiohttp.ClientSession, url: str, model: str) -> Send:
    """OpenAI's streamed ``/v1/chat/completions`` (llama-server, vLLM): the same prompt as a user turn,
    greedy, ``max_tokens`` and ``ignore_eos`` as ours; tokens counted from the final ``usage``."""

    async def send(item: Item) -> Received:
        body = {"model": model, "messages": [{"role": "user", "content": item.text_input}],
                "max_tokens": item.max_tokens, "ignore_eos": item.ignore_eos, "temperature": 0.0}
        begin, chunks, tokens = time.perf_counter(), [], None
        async for data in chat_events(session, url, body):
            if data.get("choices") and data["choices"][0]["delta"].get("content"):
                chunks.append(time.perf_counter() - begin)
            tokens = (data.get("usage") or {}).get("completion_tokens", tokens)
        if tokens is None or not chunks:
            raise RuntimeError("chat completion stream ended without usage or without text")
        return Received(tokens, chunks[0], tuple(chunks))

    return send


async def chat_events(session: aiohttp.ClientSession, url: str, body: dict) -> AsyncIterator[dict]:
    """The events of ``body`` as a streamed ``/v1/chat/completions`` with its usage at the end, parsed;
    a refusal raises."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"chat completion failed: {reply.status} {await reply.text()}")
        async for line in reply.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield json.loads(line[6:])


async def openai_prompt_tokens(session: aiohttp.ClientSession, url: str, model: str, text: str) -> int:
    """How many tokens a peer makes of ``text`` as a user turn (its chat template and tokenizer)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
        return (await reply.json())["usage"]["prompt_tokens"]


def grpc_infer(client: grpcaio.InferenceServerClient) -> Send:
    """KServe ModelInfer on ``ensemble_infer``: one response, so TTFT is the latency."""
    outputs = [grpcclient.InferRequestedOutput("completion_tokens")]

    async def send(item: Item) -> Received:
        inputs = build_inputs(grpcclient, Prompt(item.text_input, item.max_tokens, ignore_eos=item.ignore_eos))
        begin = time.perf_counter()
        result = await client.infer("ensemble_infer", inputs, outputs=outputs)
        return Received(int(result.as_numpy("completion_tokens")[0][0]), time.perf_counter() - begin)

    return send


def grpc_stream(client: grpcaio.InferenceServerClient) -> Send:
    """The bidirectional gRPC stream on ``ensemble`` with ``stream: true``, a stream per request (as
    ``client.ChatClient`` does): a response per chunk, the last with its ``finish_reason``."""

    async def send(item: Item) -> Received:
        inputs = build_inputs(grpcclient, Prompt(item.text_input, item.max_tokens, ignore_eos=item.ignore_eos),
                              stream=True)

        async def request():
            yield {"model_name": "ensemble", "inputs": inputs}

        begin, chunks = time.perf_counter(), []
        responses = client.stream_infer(request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise RuntimeError(f"gRPC stream failed: {error}")
                value = lambda name: result.as_numpy(name)[0][0]  # noqa: E731
                if value("text_output") or not chunks:
                    chunks.append(time.perf_counter() - begin)
                if value("finish_reason"):
                    return Received(int(value("completion_tokens")), chunks[0], tuple(chunks))
        finally:
            responses.cancel()  # the stream stays open after a decoupled model's last response: close it
        raise RuntimeError("gRPC stream ended without a final response")

    return send


def http_generate_ids(session: aiohttp.ClientSession, url: str, model: str, ids: dict[str, list[int]]) -> Send:
    """``generate`` with token ids straight to ``llm``, or with the same request's text to ``ensemble``."""

    async def send(item: Item) -> Received:
        body = {"max_tokens": item.max_tokens, "ignore_eos": item.ignore_eos}
        body.update({"input_ids": ids[item.text_input]} if model == "llm" else {"text_input": item.text_input})
        begin = time.perf_counter()
        async with session.post(f"{url}/v2/models/{model}/generate", json=body) as reply:
            data = await reply.json()
            if reply.status != 200:
                raise RuntimeError(f"{model} generate failed: {data}")
            out = data.get("output_ids")  # generate gives a lone id as a scalar
            tokens = (len(out) if isinstance(out, list) else 1) if model == "llm" else data["completion_tokens"]
            return Received(tokens, time.perf_counter() - begin)

    return send


def server_stats(url: str) -> dict[str, dict]:
    stats = requests.get(f"{url}/v2/models/stats", timeout=30).json()["model_stats"]
    return {s["name"]: s for s in stats if s["name"] in MODELS}


def stats_delta(before: dict, after: dict) -> dict[str, dict]:
    """Per composing model: requests, executions, and mean queue / compute ms per request."""
    out = {}
    for name, now in after.items():
        then = before.get(name)
        if then is None:
            continue
        count = now["inference_count"] - then["inference_count"]
        if count <= 0:
            continue

        def ms(key: str) -> float:
            return (now["inference_stats"][key]["ns"] - then["inference_stats"][key]["ns"]) / count / 1e6

        out[name] = {
            "requests": count,
            "executions": now["execution_count"] - then["execution_count"],
            "queue_ms": ms("queue"),
            "compute_ms": ms("compute_input") + ms("compute_infer") + ms("compute_output"),
        }
    return out


def summary(run: Run) -> dict:
    lat = np.array(run.latencies) * 1000
    ttft = np.array(run.ttfts) * 1000
    tokens = int(sum(run.tokens))
    return {
        "requests": len(run.latencies),
        "seconds": run.seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / run.seconds,
        "requests_per_s": len(run.latencies) / run.seconds,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_pct": 100 * run.client_cpu_s / run.seconds,
    } | chunking(run)


def chunking(run: Run) -> dict:
    """Tokens per chunk and the time between a reply's chunks (p50, p99), where the system streamed."""
    if not sum(run.chunks):
        return {}
    gaps = np.array(run.gaps or [0.0]) * 1000
    return {"tokens_per_chunk": sum(run.tokens) / sum(run.chunks), "chunk_gap_p50_ms": float(np.percentile(gaps, 50)),
            "chunk_gap_p99_ms": float(np.percentile(gaps, 99))}
