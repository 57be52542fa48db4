"""Async closed-loop load: ``concurrency`` clients, each sending its next request when the last returns.

aiohttp for HTTP and tritonclient's asyncio gRPC client, so one Python process on two cores can keep 32
requests in flight without becoming the bottleneck; the client's own CPU time is reported with every point.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp
import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from bench.workload import Item
from client import Prompt, build_inputs

Send = Callable[[Item], Awaitable[int]]  # returns the number of generated tokens
MODELS = ("ensemble", "preprocess", "llm", "postprocess")


@dataclass
class Run:
    """What one closed-loop run measured: per-request latencies and token counts, wall and client CPU."""

    latencies: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
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
            tokens = await send(item)
            run.latencies.append(time.perf_counter() - begin)
            run.tokens.append(tokens)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    run.seconds, run.client_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return run


def http_generate(session: aiohttp.ClientSession, url: str) -> Send:
    async def send(item: Item) -> int:
        body = {"text_input": item.text_input, "max_tokens": item.max_tokens, "ignore_eos": item.ignore_eos}
        async with session.post(f"{url}/v2/models/ensemble/generate", json=body) as reply:
            data = await reply.json()
            if reply.status != 200:
                raise RuntimeError(f"generate failed: {data}")
            return data["completion_tokens"]

    return send


def grpc_infer(client: grpcaio.InferenceServerClient) -> Send:
    outputs = [grpcclient.InferRequestedOutput("completion_tokens")]

    async def send(item: Item) -> int:
        inputs = build_inputs(grpcclient, Prompt(item.text_input, item.max_tokens, ignore_eos=item.ignore_eos))
        result = await client.infer("ensemble", inputs, outputs=outputs)
        return int(result.as_numpy("completion_tokens")[0][0])

    return send


def http_infer_ids(session: aiohttp.ClientSession, url: str, model: str, ids: dict[str, list[int]]) -> Send:
    """KServe v2 JSON infer: token ids straight to ``llm``, or the same request's text to ``ensemble``."""

    async def send(item: Item) -> int:
        common = [
            {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [item.max_tokens]},
            {"name": "ignore_eos", "shape": [1, 1], "datatype": "BOOL", "data": [item.ignore_eos]},
        ]
        if model == "llm":
            prompt = ids[item.text_input]
            inputs = [{"name": "input_ids", "shape": [1, len(prompt)], "datatype": "INT32", "data": prompt}]
            wanted = "output_ids"
        else:
            inputs = [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [item.text_input]}]
            wanted = "completion_tokens"
        body = {"inputs": inputs + common, "outputs": [{"name": wanted}]}
        async with session.post(f"{url}/v2/models/{model}/infer", json=body) as reply:
            data = await reply.json()
            if reply.status != 200:
                raise RuntimeError(f"{model} infer failed: {data}")
            out = data["outputs"][0]
            return len(out["data"]) if model == "llm" else out["data"][0]

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
    tokens = int(sum(run.tokens))
    return {
        "requests": len(run.latencies),
        "seconds": run.seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / run.seconds,
        "requests_per_s": len(run.latencies) / run.seconds,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_pct": 100 * run.client_cpu_s / run.seconds,
    }
