"""The front end's one way into Triton: a gRPC stream per generation to ``ensemble``, and for ``/tokenize``
and ``/detokenize`` one call to the pipeline's own ``preprocess`` or ``postprocess`` (so a count is the
pipeline's, with its tokenizer and template, swapped or not).

Every generation streams, whatever the client asked: the first response tells whether the pipeline took
the request (so a bad request is a 4xx before any byte of a stream goes out), and a client that goes away
cancels the stream, which Triton hands on to llm (``ipc/cancel.py``) so its batch row is freed.

Triton 2.51 never answers the requests a dead decoupled stub held, so a watch on llm's stub processes
(``ipc/stubs.py``, the same one ensemble_infer uses) fails every generation in flight when one dies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from client import OUTPUTS, STREAM_MODEL, Chunk, Prompt, build_inputs, chunk_of, infer_input, reasoned
from contract.errors import classify
from contract.reasoning import Splitter
from contract.schema import request_fields
from ipc.stubs import DeathWatch

log = logging.getLogger("openai_frontend")

WATCH_SECONDS = 1.0
ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")  # Triton's, before the failing step's own message
GUARDED_MODELS = ("llm", "preprocess", "postprocess")
PREPROCESS, POSTPROCESS = "preprocess", "postprocess"
PREPROCESS_INPUTS = frozenset(f.name for f in request_fields(PREPROCESS))
# tritonclient's channel options, with gRPC's reconnect backoff bounded: by default it grows to 2 minutes
# while Triton is down (starting, restarting), so a Triton ready again would still be answered 503 that long.
KEEPALIVE = grpcclient.KeepAliveOptions()
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", KEEPALIVE.keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", KEEPALIVE.keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", KEEPALIVE.keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", KEEPALIVE.http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class PipelineError(Exception):
    """A generation that failed; ``kind`` is ``invalid`` (the client's mistake), ``overloaded``,
    ``unavailable`` (Triton unreachable, or a stub died), ``internal`` or ``cancelled``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _error(error: Exception) -> PipelineError:
    if isinstance(error, InferenceServerException):
        message = error.message() or str(error)
        if "failed to connect" in message.lower() or "unavailable" in (error.status() or "").lower():
            return PipelineError("unavailable", f"Triton is unreachable: {message}")
        return PipelineError(classify(message), ENSEMBLE_PREFIX.sub("", message))
    if isinstance(error, grpc.aio.AioRpcError):  # its text is a multi-line dump: its code and details say it
        return PipelineError("unavailable", f"Triton is unreachable: {error.code().name}: {error.details()}")
    return PipelineError("unavailable", f"Triton is unreachable: {error}")


def launcher_state(path: str | None) -> dict:
    """The state ``make serve``'s launcher writes (launcher/supervisor.py): ``triton_pid``, the tritonserver
    running now, and ``restarts`` by process; empty without one."""
    try:
        return json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}


class PipelineClient:
    """The pipeline (Triton's ensemble) as the front end calls it, over one gRPC channel. ``server_pid``: the tritonserver whose stubs to watch (None: any on this host), or ``state``: the
    launcher's state file, which names the one running now, restarted or not."""

    def __init__(self, url: str, server_pid: int | None = None, state: str | None = None) -> None:
        self.url, self.state = url, state
        self.client: aio.InferenceServerClient | None = None  # made on the serving loop: gRPC aio binds to it
        self.deaths = DeathWatch(GUARDED_MODELS, launcher_state(state).get("triton_pid", server_pid))
        self._inboxes: set[asyncio.Queue] = set()  # one per generation in flight
        self._watch: asyncio.Task | None = None
        self._fingerprint: str | None = None  # preprocess's tokenizer, which postprocess asks ids to come from

    async def start(self) -> None:
        self.client = aio.InferenceServerClient(self.url, channel_args=CHANNEL_OPTIONS)
        self._watch = asyncio.create_task(self._watch_stubs())

    async def close(self) -> None:
        if self._watch:
            self._watch.cancel()
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(STREAM_MODEL)
        except Exception:  # unreachable is not ready
            return False

    async def generate(self, prompt: Prompt) -> AsyncIterator[Chunk]:
        """The chunks of one generation, the last with its finish_reason, a thinking model's thinking in
        their reasoning_output (``client.reasoned``); raises ``PipelineError``.
        Closing the iterator early cancels the generation in Triton."""
        inbox: asyncio.Queue = asyncio.Queue()
        done = asyncio.Event()
        request = {"model_name": STREAM_MODEL, "inputs": build_inputs(grpcclient, prompt, stream=True),
                   "outputs": [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]}

        async def requests():
            yield request
            await done.wait()  # the request side stays open until the reply is complete

        responses = self.client.stream_infer(requests())

        async def read() -> None:
            try:
                async for result, error in responses:
                    inbox.put_nowait(error or result)
                    if error is not None:
                        return
            except Exception as e:  # the stream broke: Triton went away
                inbox.put_nowait(e)

        self._inboxes.add(inbox)
        reader = asyncio.create_task(read())
        splitter = Splitter()  # a thinking model's thinking, out of the text (contract/reasoning.py)
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, Exception):
                    raise item if isinstance(item, PipelineError) else _error(item)
                chunk = reasoned(chunk_of(item), splitter)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            self._inboxes.discard(inbox)
            done.set()
            responses.cancel()
            reader.cancel()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """``prompt``'s token ids as ``preprocess`` makes them for a generation; raises ``PipelineError``."""
        inputs = [t for t in build_inputs(grpcclient, prompt) if t.name() in PREPROCESS_INPUTS]
        result = await self._infer(PREPROCESS, inputs, ("input_ids", "tokenizer_fingerprint"))
        self._fingerprint = result.as_numpy("tokenizer_fingerprint")[0][0].decode()
        return result.as_numpy("input_ids")[0].tolist()

    async def detokenize(self, ids: list[int]) -> str:
        """The text ``postprocess`` makes of ``ids`` as a whole reply (special tokens left out); raises
        ``PipelineError``. Asks preprocess for its tokenizer's fingerprint first, and again once when
        postprocess refuses it (the tokenizer was swapped since)."""
        for attempt in range(2):
            if self._fingerprint is None or attempt:
                await self.tokenize(Prompt(text_input=" ", apply_chat_template=False))
            try:
                return await self._decode(ids, self._fingerprint)
            except PipelineError as e:
                if attempt or not str(e).startswith("tokenizer_fingerprint"):
                    raise
        raise AssertionError("unreachable")

    async def _decode(self, ids: list[int], fingerprint: str) -> str:
        tensor = partial(infer_input, grpcclient)
        count = np.array([[len(ids)]], dtype=np.int32)
        inputs = [tensor("output_ids", np.array([ids], dtype=np.int32), "INT32"),
                  tensor("sent_tokens", np.zeros((1, 1), dtype=np.int32), "INT32"),
                  tensor("completion_tokens", count, "INT32"), tensor("prompt_tokens", np.zeros((1, 1), dtype=np.int32), "INT32"),
                  tensor("finish_reason", np.array([[b"stop"]], dtype=np.object_), "BYTES"),
                  tensor("tokenizer_fingerprint", np.array([[fingerprint.encode()]], dtype=np.object_), "BYTES")]
        result = await self._infer(POSTPROCESS, inputs, ("text_output",))
        return result.as_numpy("text_output")[0][0].decode("utf-8")

    async def _infer(self, model: str, inputs: list, outputs: tuple[str, ...]):
        try:
            return await self.client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in outputs])
        except Exception as e:
            raise _error(e) from None

    async def _watch_stubs(self) -> None:
        """Fail every generation in flight when a pipeline stub dies: Triton would never answer them."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            pid = launcher_state(self.state).get("triton_pid", self.deaths.server_pid)
            if pid != self.deaths.server_pid:  # the launcher started another (launcher/supervisor.py)
                self.deaths = DeathWatch(GUARDED_MODELS, pid)
            try:
                dead = await asyncio.to_thread(self.deaths.look)
            except Exception as e:  # the watch must outlive a failed look
                log.warning("stub watch: %s", e)
                continue
            if dead:
                model = sorted(dead)[0]
                log.error("the Python stub of '%s' died: failing %d generations in flight", model, len(self._inboxes))
                for inbox in list(self._inboxes):
                    inbox.put_nowait(PipelineError(
                        "unavailable", f"the Python stub of '{model}' died with this request in flight; retry"))
