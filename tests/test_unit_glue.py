"""The model.py glue with a stand-in for triton_python_backend_utils: per-request errors in one batch.

The real behaviour is proven against tritonserver elsewhere; this pins down, deterministically, that one
bad request in an ``execute`` call never costs its batch-mates their answers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np
import pytest
import torch
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2
from transformers import LlamaConfig, LlamaForCausalLM

from launcher.triton import MODEL_REPOSITORY
from llm import Generator, LLMConfig


class TritonError(Exception):
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list, error: TritonError | None = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


def fake_pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor, module.InferenceResponse, module.TritonError = Tensor, InferenceResponse, TritonError
    module.get_input_tensor_by_name = lambda request, name: request.get(name)
    module.Logger = types.SimpleNamespace(log_info=print, log_verbose=print, log_error=print, log_warn=print)
    return module


@pytest.fixture
def load_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    monkeypatch.delitem(sys.modules, "serving.glue", raising=False)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_model", MODEL_REPOSITORY / name / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.TritonPythonModel()

    return load


@pytest.fixture
def llm_model(load_model):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)
    model = load_model("llm")
    model.generator = Generator(LLMConfig("unused"), torch.device("cpu"), LlamaForCausalLM(config))
    model.generator.eos_ids = set()
    return model


def llm_request(ids: list[int], max_tokens: int) -> dict:
    return {"input_ids": Tensor("input_ids", np.array([ids], dtype=np.int32)),
            "max_tokens": Tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32))}


def test_llm_answers_the_good_requests_of_a_batch_with_a_bad_one(llm_model):
    batch = [llm_request([1, 2, 3], 5), llm_request([4, 5], 0), llm_request([7], 3), llm_request([1, 500], 2)]
    responses = llm_model.execute(batch)
    assert [r.error.code if r.error else None for r in responses] == [None, "INVALID_ARG", None, "INVALID_ARG"]
    alone = [llm_model.execute([batch[i]])[0].outputs["output_ids"] for i in (0, 2)]
    assert [responses[i].outputs["output_ids"].tolist() for i in (0, 2)] == [a.tolist() for a in alone]
    assert [responses[i].outputs["output_ids"].shape for i in (0, 2)] == [(1, 5), (1, 3)]


def test_llm_turns_a_failed_forward_pass_into_errors_not_a_crash(llm_model, monkeypatch):
    def broken(batch):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(llm_model.generator, "generate", broken)
    responses = llm_model.execute([llm_request([1], 2), llm_request([2], 2)])
    assert [r.error.code for r in responses] == ["INTERNAL", "INTERNAL"]
    assert "out of memory" in str(responses[0].error)


def test_preprocess_answers_the_good_requests_of_a_batch_with_bad_ones(load_model, model_dir, monkeypatch):
    monkeypatch.setenv("MODEL_DIR", str(model_dir))
    model = load_model("preprocess")
    config = (MODEL_REPOSITORY / "preprocess" / "config.pbtxt").read_text()
    parsed = json_format.MessageToDict(text_format.Parse(config, model_config_pb2.ModelConfig()), preserving_proto_field_name=True)
    model.initialize({"model_config": json.dumps(parsed)})

    def text(raw: bytes) -> dict:
        return {"text_input": Tensor("text_input", np.array([[raw]], dtype=np.object_))}

    responses = model.execute([text(b"hello"), text(b"\xff"), {}, text(b"world")])
    assert [r.error.code if r.error else None for r in responses] == [None, "INVALID_ARG", "INVALID_ARG", None]
    assert "text_input is required" in str(responses[2].error)
    assert responses[0].outputs["input_ids"].shape[0] == 1
