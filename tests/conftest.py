"""One real tritonserver per test session, on free ports, with the real default model."""

from __future__ import annotations

import os
import shutil
from enum import Enum
from pathlib import Path

import pytest
import requests
import torch
from pydantic import BaseModel
from transformers import AutoTokenizer

from client import ChatClient
from launcher.frontend import OpenAIFrontend
from launcher.model_folder import prepare_default_model
from launcher.paths import MODEL_REPOSITORY
from launcher.process import Ports, free_port
from launcher.repository import repository_variant
from launcher.tritonserver import TritonServer
from llm import kernels, resolve_dtype

ADMIN_KEY = "test-admin-key"


class Unit(str, Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Weather(BaseModel):
    """The weather in a city (its schema has $defs, as pydantic writes an enum's): the tool the API suites call."""

    city: str
    unit: Unit


class Colour(BaseModel):
    """A typed output the API suites ask for."""

    name: str
    warm: bool


class Letters:
    """A stand-in tokenizer for the engine's tests: token i is one letter, so stop strings can be written down."""

    def __init__(self, size: int = 256) -> None:
        self.size = size

    def decode(self, ids: list[int], **_) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.size)}
def head_dim_64_model(positions: int = 64):
    """A tiny seeded Llama whose heads our attention kernel takes (head_dim 64) and whose widths int4 groups."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=positions, eos_token_id=None,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model


_servers: list[TritonServer] = []


def forced_kernels(request: pytest.FixtureRequest):
    """``CPU_KERNELS`` set to ``request.param`` (a level of ``llm.kernels.LEVELS``, or none) for what the test
    builds and runs; a level this CPU cannot execute is skipped, naming the flags it lacks."""
    if request.param != "none" and (why := kernels.build(request.param)) is not None:
        pytest.skip(why)
    with kernels.using(None if request.param == "none" else request.param):
        yield request.param


# Every kernel level in turn (the kernel tests), and those and none (what runs without them: oneDNN, torch).
level = pytest.fixture(params=list(kernels.LEVELS))(forced_kernels)
cpu_kernels = pytest.fixture(params=[*kernels.LEVELS, "none"])(forced_kernels)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def running_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, repository: Path = MODEL_REPOSITORY,
                   **env: str):
    """A server on ``repository``; ``env`` sets the configs' variables (``STREAM_INTERVAL="4"``)."""
    log_path = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    # Tokenizer copies live under pytest's temporary folder, so that is a model root too.
    roots = os.pathsep.join([str(model_dir.parent), str(tmp_path_factory.getbasetemp())])
    triton = TritonServer(ports=Ports.free(), model_repository=repository, log_path=log_path, admin_key=ADMIN_KEY,
                          model_env={"MODEL_DIR": str(model_dir), "MODEL_ROOTS": roots, **env})
    triton.start()
    _servers.append(triton)
    try:
        triton.wait_ready(timeout=600)  # a first start compiles llm (minutes on 2 cores)
        yield triton
    finally:
        triton.stop()
        _servers.remove(triton)


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    """The shipped repository with llm's activations in float32 (``exact_repository``), so that tests may
    compare the replies of separate requests exactly. With float32 activations the engine gives the same
    tokens whatever the batch on the CPU, and whatever the prefix cache held (our kernels give a row the same
    sums whatever the rows beside it); in bfloat16 rounding differs with the shape of the step (the
    batch-mates, or a prompt's prefix found in the cache and only its tail prefilled) and flips near ties: 5
    of about 200 soak replies, and 20 of 60 48-token replies repeated after their prefix was cached
    (measured, docs/configuration.md). Where the automatic dtype is bfloat16 it is served by the tests that
    start their own servers (test_cli.py, test_kubernetes.py, test_bench.py's quick benchmark)."""
    yield from running_server(model_dir, tmp_path_factory, exact_repository(tmp_path_factory))


def exact_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped repository where ``dtype: auto`` keeps float32 activations (CPUs without native bfloat16,
    their linear layers in bfloat16 on our kernels), else a copy with llm in float32 (``server`` says why)."""
    if resolve_dtype("auto", torch.device("cpu")) == torch.float32:
        return MODEL_REPOSITORY

    def float32(config: str) -> str:
        return config.replace('key: "dtype" value: { string_value: "auto" }', 'key: "dtype" value: { string_value: "float32" }')

    return repository_variant(tmp_path_factory.mktemp("float32") / "repository", float32)


def running_frontend(server: TritonServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory, **env: str):
    """``python -m openai_frontend`` for ``server``, as ``make serve`` starts it; ``env`` adds settings."""
    log_path = tmp_path_factory.mktemp("openai") / "openai.log"
    frontend = OpenAIFrontend(server, model_dir.name, env=env, log_path=log_path, port=free_port()).start()
    try:
        frontend.wait_ready()
        yield frontend
    finally:
        frontend.stop()


@pytest.fixture(scope="session")
def openai_frontend(server: TritonServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> OpenAIFrontend:
    yield from running_frontend(server, model_dir, tmp_path_factory)


@pytest.fixture
def openai_client(openai_frontend: OpenAIFrontend):
    """The official ``openai`` client on the session's front end, without its retries (they hide errors)."""
    import openai

    client = openai.OpenAI(base_url=f"{openai_frontend.url}/v1", api_key="unused", max_retries=0, timeout=300)
    yield client
    client.close()


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


def metric_value(server: TritonServer, name: str) -> float:
    """The current value of one of llm's custom metrics on ``server``'s metrics port."""
    text = requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture
def llm_metric(server: TritonServer):
    """``metric_value`` on the session's server."""
    return lambda name: metric_value(server, name)


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


def with_template(model_dir: Path, folder: Path, template: Path) -> Path:
    """``folder`` holding the default tokenizer with ``template`` as its chat template (a template fixture:
    hermes tools, thinking), to load or swap in."""
    for file in model_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(file, folder / file.name)
    shutil.copy2(template, folder / "chat_template.jinja")
    return folder


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
    """Show the tail of each server's log under any failing server test: those running, and any that
    died (a server stopped by its fixture is no longer listed)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _servers and item.path.name.startswith("test_server_"):
        for triton in _servers:
            code = triton.process.poll()
            state = "running" if code is None else f"EXITED with code {code}"
            report.sections.append((f"tritonserver ({state}) log {triton.log_path} (last 60 lines)", triton.log_tail(60)))


