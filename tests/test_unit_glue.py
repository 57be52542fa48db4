"""The model.py glue with a stand-in for triton_python_backend_utils: per-request errors in one batch.

The real behaviour is proven against tritonserver elsewhere; this pins down, deterministically, that one
bad request in an ``execute`` call never costs its batch-mates their answers.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import Letters
from ipc import delivery
from launcher.paths import MODEL_REPOSITORY
from llm import LLM, LLMConfig
from llm.service import EngineLoop


class TritonError(Exception):
    INVALID_ARG, INTERNAL, CANCELLED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self.array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list, error: TritonError | None = None) -> None:
        self.outputs = {t.name(): t.array for t in output_tensors}
        self.error = error


FINAL = 1


class Sender:
    """Records what the model sends for one request; ``done`` is set by the final flag."""

    def __init__(self) -> None:
        self.responses: list[InferenceResponse] = []
        self.done = threading.Event()

    def send(self, response: InferenceResponse, flags: int = 0) -> None:
        self.responses.append(response)
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class Request(dict):
    """Input tensors by name, and the response sender of a decoupled model."""

    def __init__(self, **tensors) -> None:
        super().__init__(tensors)
        self.sender = Sender()

    def get_response_sender(self) -> Sender:
        return self.sender

    def inputs(self) -> list[Tensor]:
        return list(self.values())

    def is_cancelled(self) -> bool:
        return False


class Counter:
    def __init__(self, **_) -> None:
        self.value = 0

    def increment(self, by: int) -> None:
        self.value += by


class MetricFamily:
    COUNTER = "counter"

    def __init__(self, **_) -> None:
        pass

    def Metric(self, **kwargs) -> Counter:  # noqa: N802 (python_backend's name)
        return Counter(**kwargs)


def fake_pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.Tensor, module.InferenceResponse, module.TritonError = Tensor, InferenceResponse, TritonError
    module.MetricFamily = MetricFamily
    module.get_input_tensor_by_name = lambda request, name: request.get(name)
    module.Logger = types.SimpleNamespace(log_info=print, log_verbose=print, log_error=print, log_warn=print)
    return module


@pytest.fixture
def load_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    for module in [m for m in sys.modules if m.startswith("triton_glue.")]:
        monkeypatch.delitem(sys.modules, module)  # imported anew with the stand-in

    def load(name: str):
        return importlib.import_module(f"triton_glue.{name}_model").TritonPythonModel()

    return load


@pytest.fixture
def boards(tmp_path, monkeypatch):
    monkeypatch.setattr(delivery, "BOARDS", tmp_path / "boards")


@pytest.fixture
def llm_model(load_model, boards):
    """The llm glue around a tiny random model, initialised by hand (no metrics; its delivery board in a
    temporary folder)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)
    model = load_model("llm")
    model.llm = LLM(LLMConfig("unused", compile=False), torch.device("cpu"), LlamaForCausalLM(config), Letters(128))
    model.llm.eos_ids = set()
    model.ids = (f"1-{n}" for n in itertools.count())
    model.fingerprint = np.array([[b"f"]], dtype=np.object_)
    model.pending = {}
    model.board = delivery.Board()
    model.loop = EngineLoop(model.llm.engine, model._respond, model._poll, print)
    yield model
    model.finalize()


def llm_request(ids: list[int], max_tokens: int) -> Request:
    return Request(input_ids=Tensor("input_ids", np.array([ids], dtype=np.int32)),
                   max_tokens=Tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32)))


def answers(batch: list[Request]) -> list[InferenceResponse]:
    """The final response of each request, once the engine thread has sent it."""
    for request in batch:
        assert request.sender.done.wait(60)
    return [request.sender.responses[-1] for request in batch]


def test_llm_answers_the_good_requests_of_a_batch_with_a_bad_one(llm_model):
    batch = [llm_request([1, 2, 3], 5), llm_request([4, 5], 0), llm_request([7], 3), llm_request([1, 500], 2)]
    assert llm_model.execute(batch) is None  # decoupled: answers come from the engine thread
    responses = answers(batch)
    assert [r.error.code if r.error else None for r in responses] == [None, "INVALID_ARG", None, "INVALID_ARG"]
    again = [llm_request([1, 2, 3], 5), llm_request([7], 3)]
    llm_model.execute(again)
    alone = [r.outputs["output_ids"].tolist() for r in answers(again)]
    assert [responses[i].outputs["output_ids"].tolist() for i in (0, 2)] == alone
    assert [responses[i].outputs["output_ids"].shape for i in (0, 2)] == [(1, 5), (1, 3)]


def test_llm_turns_a_failed_forward_pass_into_errors_and_keeps_serving(llm_model, monkeypatch):
    def broken(step):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(llm_model.loop.engine.runner, "run", broken)
    batch = [llm_request([1], 2), llm_request([2], 2)]
    llm_model.execute(batch)
    responses = answers(batch)
    assert [r.error.code for r in responses] == ["INTERNAL", "INTERNAL"]
    assert "out of memory" in str(responses[0].error)
    monkeypatch.undo()
    later = [llm_request([3], 2)]
    llm_model.execute(later)
    assert answers(later)[0].error is None


def test_an_engine_that_fails_to_build_fails_the_load_with_its_reason():
    def build():
        raise RuntimeError("kv_cache_tokens too large")

    with pytest.raises(RuntimeError, match="kv_cache_tokens too large"):
        EngineLoop(build, lambda update: None, on_error=print)


def model_config(model: str) -> str:
    """The config as Triton hands it to ``initialize``: JSON with the proto's field names."""
    config = text_format.Parse((MODEL_REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True))


def test_postprocess_reports_each_response_it_finished_to_the_llm_that_sent_it(load_model, model_dir, boards,
                                                                               monkeypatch):
    """The delivery board (ipc/delivery.py): llm's coalescing waits on these marks, so every response of a
    stream is marked, a refused one too; a response without a generation id (a caller of postprocess
    alone) marks nothing."""
    monkeypatch.setenv("MODEL_DIR", str(model_dir))
    model = load_model("postprocess")
    model.initialize({"model_config": model_config("postprocess")})
    board = delivery.Board()

    def response(n: int, ids: list[int], tokens: int, fingerprint: str | None = None) -> Request:
        fields = {"output_ids": np.array([ids], dtype=np.int32), "sent_tokens": np.array([[0]], dtype=np.int32),
                  "completion_tokens": np.array([[tokens]], dtype=np.int32),
                  "tokenizer_fingerprint": np.array([[(fingerprint or model.detokenizer.fingerprint).encode()]], dtype=np.object_)}
        if n >= 0:
            fields["generation_id"] = np.array([[f"{os.getpid()}-{n}".encode()]], dtype=np.object_)
        return Request(**{name: Tensor(name, value) for name, value in fields.items()})

    try:
        answered = model.execute([response(1, [42, 43], 2), response(2, [44], 1, fingerprint="another"), response(-1, [45], 7)])
        assert [a.error is None for a in answered] == [True, True, True]  # the refused one mid-stream goes to llm's board
        assert [board.delivered(f"{os.getpid()}-{n}") for n in (1, 2, 7)] == [2, 1, None]
    finally:
        board.close()


def test_preprocess_answers_the_good_requests_of_a_batch_with_bad_ones(load_model, model_dir, monkeypatch):
    monkeypatch.setenv("MODEL_DIR", str(model_dir))
    model = load_model("preprocess")
    model.initialize({"model_config": model_config("preprocess")})

    def text(raw: bytes) -> dict:
        return Request(text_input=Tensor("text_input", np.array([[raw]], dtype=np.object_)))

    responses = model.execute([text(b"hello"), text(b"\xff"), Request(), text(b"world")])
    assert [r.error.code if r.error else None for r in responses] == [None, "INVALID_ARG", "INVALID_ARG", None]
    assert "text_input is required" in str(responses[2].error)
    assert responses[0].outputs["input_ids"].shape[0] == 1


def test_ensemble_infer_answers_calls_stranded_by_a_dead_stub_once_and_frees_their_slots(load_model):
    release, died = threading.Event(), threading.Event()

    class StrandedCall:  # a BLS call to ensemble that the dead stub holds: it returns only when released
        def __init__(self, **_) -> None:
            pass

        def exec(self, decoupled: bool):
            release.wait()
            return iter([InferenceResponse([Tensor("text_output", np.array([[b"late"]], dtype=np.object_))])])

    sys.modules["triton_python_backend_utils"].InferenceRequest = StrandedCall
    model = load_model("ensemble_infer")
    model.initialize({"model_config": model_config("ensemble_infer"), "model_name": "ensemble_infer", "model_version": "1"})
    model.deaths.look = lambda: {"llm"} if died.is_set() else set()  # DeathWatch itself: test_unit_stubs.py
    model.in_flight.limit = 2
    try:
        batch = [Request(), Request(), Request()]
        model.execute(batch)
        assert "overloaded" in str(batch[2].sender.responses[0].error)  # past max_in_flight
        time.sleep(1.5)  # a look of the guard: nothing died, nothing answered
        assert not any(r.sender.done.is_set() for r in batch[:2])
        died.set()
        for request in batch[:2]:
            assert request.sender.done.wait(10)
            (response,) = request.sender.responses
            assert response.error.code == "UNAVAILABLE"
            assert "stub of 'llm' died with this request in flight" in str(response.error)
        assert len(model.in_flight) == 0  # their slots are free, though their calls never returned
        assert model.stranded.value == 2
        died.clear()
        release.set()  # the stranded calls return at last: their late replies are dropped
        time.sleep(0.5)
        assert [len(r.sender.responses) for r in batch[:2]] == [1, 1]
    finally:
        release.set()
        model.finalize()
