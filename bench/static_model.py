"""Benchmark baseline ``llm``: the shipped glue's validation and responses around ``StaticGenerator``.

Triton's dynamic batcher forms a batch, ``execute`` generates it to the end and only then answers, so
a batch lasts as long as its longest reply and nothing streams: what the in-flight engine replaced.
The benchmark copies this file into its own model repository as ``llm/1/model.py``.
"""

import importlib.util
import json

import torch
import triton_python_backend_utils as pb_utils

from bench.static_llm import StaticGenerator
from launcher.triton import MODEL_REPOSITORY
from llm import LLM, LLMConfig, configure_threads
from llm.engine import Sequence
from serving.errors import InvalidInput
from serving.glue import error_response
from serving.params import read_parameters

_spec = importlib.util.spec_from_file_location("shipped_llm", MODEL_REPOSITORY / "llm" / "1" / "model.py")
shipped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shipped)


class TritonPythonModel(shipped.TritonPythonModel):
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        configure_threads(1, torch.device("cpu"))
        self.llm = LLM(read_parameters(model_config, LLMConfig), torch.device("cpu"))
        self.generator = StaticGenerator(self.llm)
        self.fingerprint = shipped.np.array([[self.llm.fingerprint.encode()]], dtype=shipped.np.object_)

    def execute(self, requests: list) -> None:
        batch = []
        for request in requests:
            handle = shipped.Handle(request.get_response_sender(), "0-0")
            try:
                batch.append(Sequence(self._validate(request), handle=handle))
            except InvalidInput as e:
                handle.sender.send(error_response(e), flags=shipped.FINAL)
        if batch:
            for seq, reply in zip(batch, self.generator.generate([s.request for s in batch])):
                seq.output_ids = reply
                seq.finish_reason = "length" if len(reply) == seq.request.max_tokens else "stop"
                self._respond(seq)
        return None

    def finalize(self) -> None:
        pb_utils.Logger.log_info("static llm: unloaded")
