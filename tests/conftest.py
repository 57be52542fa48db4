"""One real tritonserver per test session, on free ports, with the real default model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

from client import ChatClient
from launcher.model import prepare_default_model
from launcher.triton import Ports, TritonServer

ADMIN_KEY = "test-admin-key"
_servers: list[TritonServer] = []


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    log_path = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    # Tokenizer copies live under pytest's temporary folder, so that is a model root too.
    roots = os.pathsep.join([str(model_dir.parent), str(tmp_path_factory.getbasetemp())])
    triton = TritonServer(ports=Ports.free(), model_env={"MODEL_DIR": str(model_dir), "MODEL_ROOTS": roots},
                          log_path=log_path, admin_key=ADMIN_KEY)
    _servers.append(triton)
    triton.start()
    try:
        triton.wait_ready(timeout=600)  # a first start compiles llm (minutes on 2 cores)
        yield triton
    finally:
        triton.stop()


@pytest.fixture(scope="session")
def http_url(server: TritonServer) -> str:
    return server.url


@pytest.fixture(scope="session")
def grpc_url(server: TritonServer) -> str:
    return server.grpc_url


@pytest.fixture
def generate(http_url: str):
    """POST to the ensemble's ``generate`` endpoint; returns the ``requests`` response."""

    def call(body: dict, model: str = "ensemble") -> requests.Response:
        return requests.post(f"{http_url}/v2/models/{model}/generate", json=body, timeout=300)

    return call


@pytest.fixture
def llm_metric(server: TritonServer):
    """The current value of one of llm's custom metrics on Triton's metrics port."""

    def read(name: str) -> float:
        text = requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))

    return read


@pytest.fixture
def http_client(server: TritonServer) -> ChatClient:
    client = ChatClient(f"127.0.0.1:{server.ports.http}", "http")
    yield client
    client.close()


@pytest.fixture
def grpc_client(server: TritonServer) -> ChatClient:
    client = ChatClient(f"127.0.0.1:{server.ports.grpc}", "grpc")
    yield client
    client.close()


@pytest.fixture
def tokenizer_copy(model_dir: Path, tmp_path: Path):
    """A fresh copy of the default tokenizer's files, to edit and swap in."""

    def make(name: str) -> Path:
        target = tmp_path / name
        target.mkdir()
        for file in model_dir.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(file, target / file.name)
        return target

    return make


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Show the tail of the server log under any failing test that used the server."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _servers and "server" in getattr(item, "fixturenames", ()):
        report.sections.append(("tritonserver log (last 60 lines)", _servers[0].log_tail(60)))


