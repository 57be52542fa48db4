"""Does building a new grammar stall the rows already decoding? Free streams' inter-token gaps, with and
without requests that each bring a schema no request brought before.

``streams`` free requests stream side by side (``generate_stream``, greedy, ``ignore_eos``) and every gap
between two of their events is recorded, while a constrained request arrives every ``every`` seconds. The
run is made twice: every constrained request with the same schema (built once before, then served from the
grammar cache), then each with a fresh schema (new property names: a grammar built for every one). The
batches are alike; only the building differs. The free rows' p99 gap with building over without is the
figure (the goal: at most 1.5x).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np

from bench.workload import Item


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, gaps: list[float] | None) -> None:
    last = None
    async with session.post(f"{url}/v2/models/ensemble/generate_stream", json={**body, "stream": True}) as reply:
        async for line in reply.content:
            if not line.startswith(b"data: "):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"generate_stream failed: {data['error']}")
            now = time.perf_counter()
            if gaps is not None and last is not None:
                gaps.append(now - last)
            last = now


def fresh_schema(n: int) -> dict:
    """A small object schema whose property names are new for each ``n``."""
    return {"type": "object", "additionalProperties": False, "required": [f"name_{n}", f"count_{n}"], "properties": {
        f"name_{n}": {"type": "string", "maxLength": 12}, f"count_{n}": {"type": "integer", "minimum": 0, "maximum": 99},
        f"tags_{n}": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b", f"c{n}"]}}}}


async def _run(url: str, items: list[Item], every: float, fresh: bool) -> tuple[list[float], int]:
    gaps: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        free = [asyncio.create_task(_stream(session, url, {"text_input": i.text_input, "max_tokens": i.max_tokens,
                                                           "ignore_eos": True}, gaps)) for i in items]
        constrained, n = [], 0
        while not all(t.done() for t in free):
            await asyncio.sleep(every)
            body = {"text_input": "Describe an item as JSON.", "max_tokens": 24,
                    "structured_outputs": json.dumps({"json": fresh_schema(n if fresh else -1)})}
            constrained.append(asyncio.create_task(_stream(session, url, body, None)))
            n += 1
        await asyncio.gather(*free, *constrained)
    return gaps, n if fresh else 0


def measure(url: str, items: list[Item], every: float = 0.5) -> dict:
    """The free rows' inter-token gaps (p50, p99, in ms) with cached and with fresh schemas arriving, and
    the ratio of their p99s."""
    cached, _ = asyncio.run(_run(url, items[:1], every, fresh=False))  # builds the cached schema once
    cached, _ = asyncio.run(_run(url, items, every, fresh=False))
    fresh, schemas = asyncio.run(_run(url, items, every, fresh=True))
    p = lambda gaps, q: float(np.percentile(gaps, q) * 1000)  # noqa: E731
    return {"streams": len(items), "every_s": every, "fresh_schemas": schemas,
            "cached_p50_ms": p(cached, 50), "cached_p99_ms": p(cached, 99),
            "fresh_p50_ms": p(fresh, 50), "fresh_p99_ms": p(fresh, 99), "p99_ratio": p(fresh, 99) / p(cached, 99)}
