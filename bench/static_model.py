"""Benchmark baseline ``llm``: the shipped glue's validation and responses around ``StaticGenerator``.

Triton's dynamic batcher forms a batch, ``execute`` generates it to the end and only then answers, so
a batch lasts as long as its longest reply and nothing streams: what the in-flight engine replaced.
The benchmark copies this file into its own model repository as ``llm/1/model.py``.
"""

import json
from dataclasses import replace

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from bench.static_llm import StaticGenerator
from contract.errors import InvalidInput
from contract.schema import FinishReason
from contract.stops import TextTracker
from llm import LLM, LLMConfig, configure_threads, load_model
from llm.sequence import Sequence
from triton_glue import llm_model
from triton_glue.params import read_parameters
from triton_glue.tensors import error_response


class TritonPythonModel(llm_model.TritonPythonModel):
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        device = torch.device("cpu")
        configure_threads(1, device)
        config = replace(read_parameters(model_config, LLMConfig), compile=False)
        hf = load_model(config, device)
        self.llm = LLM(config, device, hf)
        self.generator = StaticGenerator(hf, self.llm)
        self.fingerprint = np.array([[self.llm.fingerprint.encode()]], dtype=np.object_)

    def execute(self, requests: list) -> None:
        batch = []
        for request in requests:
            handle = llm_model.Handle(request.get_response_sender(), "0-0")
            try:
                batch.append(Sequence(self._validate(request), handle=handle))
            except InvalidInput as e:
                handle.sender.send(error_response(e), flags=llm_model.FINAL)
        if batch:
            for seq, reply in zip(batch, self.generator.generate([s.request for s in batch])):
                seq.output_ids, seq.text = reply, TextTracker(self.llm.decode)  # one answer: every id
                seq.finish_reason = FinishReason.LENGTH if len(reply) == seq.request.max_tokens else FinishReason.STOP
                self._respond(seq)
        return None

    def finalize(self) -> None:
        pb_utils.Logger.log_info("static llm: unloaded")
