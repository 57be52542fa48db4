"""A small tritonclient-based client for the ``ensemble`` model, over HTTP or gRPC."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

MODEL = "ensemble"


@dataclass(frozen=True)
class Prompt:
    """The ensemble's inputs; None leaves an optional input out so the server default applies."""

    text_input: str
    max_tokens: int | None = None
    system_prompt: str | None = None
    apply_chat_template: bool | None = None
    ignore_eos: bool | None = None


def build_inputs(lib, prompt: Prompt) -> list:
    """``InferInput`` tensors for ``prompt`` with ``lib`` = tritonclient.http or tritonclient.grpc."""

    def tensor(name: str, value: np.ndarray, datatype: str):
        t = lib.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value)
        return t

    inputs = [tensor("text_input", np.array([[prompt.text_input.encode()]], dtype=np.object_), "BYTES")]
    if prompt.max_tokens is not None:
        inputs.append(tensor("max_tokens", np.array([[prompt.max_tokens]], dtype=np.int32), "INT32"))
    if prompt.system_prompt is not None:
        inputs.append(tensor("system_prompt", np.array([[prompt.system_prompt.encode()]], dtype=np.object_), "BYTES"))
    for name in ("apply_chat_template", "ignore_eos"):
        if getattr(prompt, name) is not None:
            inputs.append(tensor(name, np.array([[getattr(prompt, name)]], dtype=bool), "BOOL"))
    return inputs


class ChatClient:
    def __init__(self, url: str = "localhost:8000", protocol: str = "http", timeout: float = 600.0) -> None:
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
        self.protocol = protocol
        self.timeout = timeout
        self.lib = httpclient if protocol == "http" else grpcclient
        url = url.removeprefix("http://").removeprefix("grpc://")
        if protocol == "http":
            self.client = httpclient.InferenceServerClient(url, network_timeout=timeout, connection_timeout=timeout)
        else:
            self.client = grpcclient.InferenceServerClient(url)

    def generate(self, prompt: Prompt) -> str:
        """The reply text; a server-side error raises ``tritonclient.utils.InferenceServerException``."""
        outputs = [self.lib.InferRequestedOutput("text_output")]
        if self.protocol == "http":
            result = self.client.infer(MODEL, build_inputs(self.lib, prompt), outputs=outputs)
        else:
            result = self.client.infer(MODEL, build_inputs(self.lib, prompt), outputs=outputs, client_timeout=self.timeout)
        return result.as_numpy("text_output")[0][0].decode("utf-8")

    def close(self) -> None:
        self.client.close()
