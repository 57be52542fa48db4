"""A small client for the chat pipeline over HTTP or gRPC: one reply, or a stream of text chunks.

One response: KServe ``infer`` on ``ensemble_infer`` (Triton refuses ``infer`` on the decoupled
``ensemble``). Streaming: ``generate_stream`` (server-sent events) over HTTP, the bidirectional stream
over gRPC, both on ``ensemble`` with ``stream: true``. Its tensors come from ``contract/schema.py``.
``client.admin`` swaps the tokenizer through Triton's repository API.
"""

from __future__ import annotations

import json
import queue
import weakref
from dataclasses import dataclass, field, make_dataclass, replace
from functools import partial
from typing import Iterator

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from contract.reasoning import Splitter
from contract.schema import REQUEST, RESPONSE

STREAM_MODEL = "ensemble"
INFER_MODEL = "ensemble_infer"
OUTPUTS = tuple(f.name for f in RESPONSE)


def _body(self) -> dict:
    """The JSON body of ``generate`` / ``generate_stream`` (a JSON field, such as ``messages``, as the JSON
    text its input holds)."""
    return {f.name: json.dumps(getattr(self, f.name)) if f.json else getattr(self, f.name)
            for f in PROMPT_FIELDS if getattr(self, f.name) not in (None, [])}


PROMPT_FIELDS = tuple(f for f in REQUEST if f.name != "stream")  # stream is the call's choice, not the prompt's
# The ensemble's inputs, one attribute per request field of contract/schema.py, in its order; None (or an
# empty list) leaves an input out so the server default applies. ``messages`` (a conversation,
# OpenAI-style dicts) replaces ``text_input`` when given.
Prompt = make_dataclass(
    "Prompt",
    [(f.name, f.python_type, field(default_factory=list)) if f.dims == (-1,) else (f.name, f.python_type | None, None)
     for f in PROMPT_FIELDS],
    frozen=True, namespace={"body": _body, "__module__": __name__},
)


@dataclass(frozen=True)
class Chunk:
    """One response: the text it adds (the whole reply when not streaming) and the counts so far."""

    text_output: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str  # empty until the last chunk: stop or length
    token_logprobs: list[dict] | None = None  # with logprobs: the tokens this chunk's text shows
    prompt_token_logprobs: list[dict] | None = None  # with prompt_logprobs, in the first chunk: the prompt's tokens
    cached_tokens: int = 0  # of prompt_tokens, those found in the prefix cache
    stop_reason: str = ""  # in the last chunk: the stop string that ended the reply, if one did
    reasoning_state: str = ""  # where a thinking model's reply began (contract/reasoning.py); empty for other models
    reasoning_output: str = ""  # once split (``reasoned``): the thinking this chunk adds, taken out of text_output


def infer_input(lib, name: str, value: np.ndarray, datatype: str):
    """One ``InferInput`` holding ``value``, with ``lib`` = tritonclient.http or tritonclient.grpc."""
    t = lib.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value)
    return t


def build_inputs(lib, prompt: Prompt, stream: bool | None = None) -> list:
    """``InferInput`` tensors for ``prompt`` with ``lib`` = tritonclient.http or tritonclient.grpc."""

    tensor = partial(infer_input, lib)

    def text(values: list[str]) -> np.ndarray:
        return np.array([[v.encode() for v in values]], dtype=np.object_).reshape(1, len(values))

    inputs = []
    for spec in PROMPT_FIELDS:  # contract/schema.py: each field's Triton type
        value = getattr(prompt, spec.name)
        if value is None or value == []:
            continue
        if spec.json is not None:
            value = json.dumps(value)
        if spec.data_type == "TYPE_STRING":
            array = text(value if isinstance(value, list) else [value])
        else:
            array = np.array([value if isinstance(value, list) else [value]], dtype=spec.numpy_type)
        inputs.append(tensor(spec.name, array, spec.wire_type))
    if stream is not None:
        inputs.append(tensor("stream", np.array([[stream]], dtype=bool), "BOOL"))
    return inputs


def parse_logprobs(raw: bytes | str) -> list[dict] | None:
    """The ``token_logprobs`` output: None when the request did not ask for logprobs."""
    return json.loads(raw) if raw else None


def chunk_of(result) -> Chunk:
    """One ensemble response (an ``InferResult`` of either protocol) as a ``Chunk``."""
    value = lambda name: result.as_numpy(name)[0][0]  # noqa: E731
    return Chunk(
        value("text_output").decode("utf-8"), int(value("completion_tokens")), int(value("prompt_tokens")),
        value("finish_reason").decode("utf-8"), parse_logprobs(value("token_logprobs")),
        parse_logprobs(value("prompt_token_logprobs")), int(value("cached_tokens")), value("stop_reason").decode("utf-8"),
        value("reasoning_state").decode("utf-8"),
    )


def reasoned(chunk: Chunk, splitter: Splitter) -> Chunk:
    """``chunk`` with a thinking model's thinking moved from ``text_output`` to ``reasoning_output``; one
    ``splitter`` per reply, fed every chunk in order (a chunk that is the whole reply: a fresh one)."""
    reasoning, content = splitter.feed(chunk.text_output, chunk.reasoning_state, bool(chunk.finish_reason))
    return replace(chunk, text_output=content, reasoning_output=reasoning)


class ChatClient:
    def __init__(self, url: str = "localhost:8000", protocol: str = "http", timeout: float = 600.0) -> None:
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
        self.protocol = protocol
        self.timeout = timeout
        self.url = url.removeprefix("http://").removeprefix("grpc://")
        if protocol == "http":
            self.lib = httpclient
            self.client = httpclient.InferenceServerClient(self.url, network_timeout=timeout, connection_timeout=timeout)
        else:
            self.lib = grpcclient
            self.client = grpcclient.InferenceServerClient(self.url)
        # Closed at exit at the latest, while gRPC's threads still run: tritonclient's own __del__ closes the
        # channel during interpreter shutdown, after daemon threads are frozen, and waits for one of them
        # forever (seen here: a script that streamed, then ended, hung about 1 run in 10).
        self._closer = weakref.finalize(self, self.client.close)

    def close(self) -> None:
        """End the connection (and a stream still open); later calls fail."""
        self._closer()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: Prompt) -> Chunk:
        """The whole reply; a server-side error raises ``tritonclient.utils.InferenceServerException``."""
        outputs = [self.lib.InferRequestedOutput(name) for name in OUTPUTS]
        timeout = {"client_timeout": self.timeout} if self.protocol == "grpc" else {}
        result = self.client.infer(INFER_MODEL, build_inputs(self.lib, prompt), outputs=outputs, **timeout)
        return reasoned(chunk_of(result), Splitter())

    def stream(self, prompt: Prompt) -> Iterator[Chunk]:
        """Text chunks as tokens are generated, the last one with its finish_reason (a thinking model's
        thinking in reasoning_output)."""
        chunks = self._stream_http(prompt) if self.protocol == "http" else self._stream_grpc(prompt)
        splitter = Splitter()
        try:
            for chunk in chunks:
                yield reasoned(chunk, splitter)
        finally:
            chunks.close()  # a consumer that stops early ends the stream

    def _stream_http(self, prompt: Prompt) -> Iterator[Chunk]:
        url = f"http://{self.url}/v2/models/{STREAM_MODEL}/generate_stream"
        with requests.post(url, json={**prompt.body(), "stream": True}, stream=True, timeout=self.timeout) as reply:
            for line in reply.iter_lines():  # errors come as events too, with a 4xx status when first
                if not line.startswith(b"data: "):
                    continue
                data = json.loads(line[len(b"data: "):])
                if "error" in data:
                    raise InferenceServerException(data["error"], status=str(reply.status_code))
                yield Chunk(data["text_output"], data["completion_tokens"], data["prompt_tokens"], data["finish_reason"],
                            parse_logprobs(data["token_logprobs"]), parse_logprobs(data["prompt_token_logprobs"]),
                            data["cached_tokens"], data["stop_reason"], data["reasoning_state"])
            if reply.status_code != 200:
                raise InferenceServerException(reply.text, status=str(reply.status_code))

    def _stream_grpc(self, prompt: Prompt) -> Iterator[Chunk]:
        answers: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            self.client.async_stream_infer(STREAM_MODEL, build_inputs(self.lib, prompt, stream=True))
            while True:
                result, error = answers.get(timeout=self.timeout)
                if error is not None:
                    raise error
                chunk = chunk_of(result)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            self.client.stop_stream(cancel_requests=True)  # a consumer that stops early cancels generation

    def close(self) -> None:
        self.client.close()
