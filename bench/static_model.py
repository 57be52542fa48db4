"""Benchmark baseline ``llm``: the shipped glue's validation and responses around ``StaticGenerator``.

Triton's dynamic batcher forms a batch, ``execute`` generates it to the end and only then answers, so
a batch lasts as long as its longest reply and nothing streams: what the in-flight engine replaced.
The benchmark copies this file into its own model repository as ``llm/1/model.py``.
"""

import importlib.util
import json
from dataclasses import replace

import torch
import triton_python_backend_utils as pb_utils

from bench.static_llm import StaticGenerator
from launcher.triton import MODEL_REPOSITORY
from llm import LLM, LLMConfig, configure_threads, load_model
from llm.sequence import Sequence
from serving.errors import InvalidInput
from serving.glue import error_response
from serving.params import read_parameters
from serving.stops import TextTracker

_spec = importlib.util.spec_from_file_location("shipped_llm", MODEL_REPOSITORY / "llm" / "1" / "model.py")
shipped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shipped)


class TritonPythonModel(shipped.TritonPythonModel):
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        device = torch.device("cpu")
        configure_threads(1, device)
        config = replace(read_parameters(model_config, LLMConfig), compile=False)
        hf = load_model(config, device)
        self.llm = LLM(config, device, hf)
        self.generator = StaticGenerator(hf, self.llm)
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
                seq.output_ids, seq.text = reply, TextTracker(self.llm.decode)  # one answer: every id
                seq.finish_reason = "length" if len(reply) == seq.request.max_tokens else "stop"
                self._respond(seq)
        return None

    def finalize(self) -> None:
        pb_utils.Logger.log_info("static llm: unloaded")
