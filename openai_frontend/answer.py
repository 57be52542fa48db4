"""Answering one request: its generations started together, merged as their pieces come, and presented
whole or as server-sent events, with the usage, the deadline, a client that leaves and a stop's drain."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from client import Chunk, Prompt
from contract.errors import UNAVAILABLE
from openai_frontend.api_errors import APIError, ClientGone
from openai_frontend.replies import Choice, Reply
from openai_frontend.schemas import Usage
from openai_frontend.shutdown import Drain
from openai_frontend.pipeline import PipelineClient, PipelineError

TIMEOUT_HEADER = "X-Request-Timeout"  # seconds; shortens (never lengthens) the server's deadline
log = logging.getLogger("openai_frontend")


class Deadline:
    def __init__(self, request: Request, seconds: float) -> None:
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                asked = float("nan")
            if not 0 < asked < float("inf"):
                raise APIError(400, f"header {TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}",
                               TIMEOUT_HEADER)
            seconds = min(seconds, asked)
        self.seconds = seconds
        self.at = asyncio.get_running_loop().time() + seconds

    def error(self) -> APIError:
        return APIError(504, f"the request did not finish within its deadline of {self.seconds:g} s", code="timeout")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generations:
    """The generations of one request (``groups``: the n prompts of each client prompt, choices numbered in
    that order), started at once; their pieces come merged, each with its choice's index. ``names``
    turns the pipeline's field names into the client's in errors (``APIError.of``)."""

    def __init__(self, triton: PipelineClient, groups: list[list[Prompt]], request: Request, deadline: Deadline,
                 drain: Drain, names: dict[str, str]) -> None:
        self.groups, self.deadline, self.drain, self.names = groups, deadline, drain, names
        self.count = sum(len(g) for g in groups)
        self.streams = [triton.generate(p) for group in groups for p in group]
        self.merged: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.streams)]
        self.watcher = asyncio.create_task(_until_disconnected(request))
        self.cut = asyncio.create_task(drain.expired.wait())
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = [0] * self.count, [0] * self.count, [0] * self.count
        self.finished: set[int] = set()

    async def _pump(self, index: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for piece in stream:
                self.merged.put_nowait((index, piece))
        except PipelineError as e:
            self.merged.put_nowait((index, e))

    async def next(self) -> tuple[int, Chunk]:
        """The next piece of any generation, counted; raises APIError (the pipeline's error, the deadline,
        a drain that ran out) and ClientGone."""
        getter = asyncio.ensure_future(self.merged.get())
        try:
            timeout = self.deadline.at - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait({getter, self.watcher, self.cut}, timeout=max(0.0, timeout),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter in done:
            index, item = getter.result()
            if isinstance(item, PipelineError):
                raise APIError.of(item, self.names)
            self.prompt_tokens[index], self.completion_tokens[index] = item.prompt_tokens, item.completion_tokens
            self.cached_tokens[index] = item.cached_tokens
            if item.finish_reason:
                self.finished.add(index)
            return index, item
        if self.watcher in done:
            raise ClientGone()
        if self.cut in done:
            raise APIError(503, f"{UNAVAILABLE}the server is stopping and its drain timeout ({self.drain.seconds:g} s) "
                                "ended this reply; retry", code="unavailable")
        raise self.deadline.error()

    async def first(self) -> list[tuple[int, Chunk]]:
        """Every generation's first piece (and what came between): the pipeline's refusals become the
        status before any byte goes out. Closes everything when it raises."""
        early: list[tuple[int, Chunk]] = []
        try:
            while len({index for index, _ in early}) < self.count:
                early.append(await self.next())
        except BaseException:
            await self.close()
            raise
        return early

    @property
    def done(self) -> bool:
        return len(self.finished) == self.count

    def usage(self) -> Usage:
        n = len(self.groups[0])  # each client prompt counts once, however many choices it has (as OpenAI counts)
        firsts = range(0, len(self.groups) * n, n)
        return Usage.of(sum(self.prompt_tokens[i] for i in firsts), sum(self.completion_tokens),
                        sum(self.cached_tokens[i] for i in firsts))

    async def close(self) -> None:
        self.watcher.cancel()
        self.cut.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()  # cancels the Triton stream, so llm frees the row


async def answer(generations: Generations, reply: Reply, metrics, route: str) -> Response:
    """Once every generation has begun: the whole reply, or the stream of events."""
    start = time.perf_counter()
    early = await generations.first()
    metrics.ttft.labels(route).observe(time.perf_counter() - start)
    if reply.body.stream:
        return StreamingResponse(_events(generations, reply, early, metrics, route), media_type="text/event-stream")
    return await _whole(generations, reply, early, metrics)


def counted(generations: Generations, metrics) -> Usage:
    """A finished request's usage, counted once in the front end's metrics (every API's replies)."""
    usage = generations.usage()
    metrics.prompt_tokens.inc(usage.prompt_tokens)
    metrics.completion_tokens.inc(usage.completion_tokens)
    return usage


async def _whole(generations: Generations, reply: Reply, early: list[tuple[int, Chunk]], metrics) -> Response:
    choices = [Choice() for _ in range(generations.count)]
    try:
        pending = early
        while True:
            for index, piece in pending:
                choices[index].add(piece)
            if generations.done:
                break
            pending = [await generations.next()]
    finally:
        await generations.close()
    return JSONResponse(reply.whole(choices, counted(generations, metrics)))


async def _events(generations: Generations, reply: Reply, early: list[tuple[int, Chunk]], metrics,
                  route: str) -> AsyncIterator[bytes]:
    begun: set[int] = set()
    try:
        pending = early
        while True:
            for index, piece in pending:
                data = reply.chunk(index, piece, index not in begun)
                if data is not None:
                    if reply.body.continuous_usage:
                        data["usage"] = generations.usage().model_dump()
                    yield _sse(data)
                begun.add(index)
            if generations.done:
                break
            pending = [await generations.next()]
        usage = counted(generations, metrics)
        if reply.body.include_usage:
            yield _sse(reply.usage_chunk(usage))
    except APIError as e:
        yield _sse(e.body())
    except (ClientGone, asyncio.CancelledError) as gone:  # seen by our watcher, or by Starlette's
        log.info("%s: the client went away during a stream; its generations are cancelled", route)
        if isinstance(gone, asyncio.CancelledError):
            raise
        return
    finally:
        await generations.close()
    yield _sse("[DONE]")


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()
