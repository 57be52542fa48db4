"""Benchmark baseline ``llm``: the shipped glue around ``StaticLoop``, the engine's port over static batching.

A batch is generated to its end before anything is answered, so it lasts as long as its longest reply
and nothing streams: what the in-flight engine replaced. Everything else (validation, responses, the
cancel board) is the shipped glue's. The benchmark copies this file into its own model repository as
``llm/1/model.py``.
"""

import itertools
import json
import os
from dataclasses import replace

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from bench.static_llm import StaticLoop
from llm.reference import StaticGenerator
from llm import LLM, LLMConfig, configure_threads, load_model
from triton_glue import llm_model
from triton_glue.params import read_parameters


class TritonPythonModel(llm_model.TritonPythonModel):
    def initialize(self, args: dict) -> None:
        config = replace(read_parameters(json.loads(args["model_config"]), LLMConfig), compile=False)
        device = torch.device("cpu")

        def build() -> StaticGenerator:  # on the loop's thread, where torch works (llm/service.py says why)
            configure_threads(1, device)
            hf = load_model(config, device)
            self.llm = LLM(config, device, hf)
            return StaticGenerator(hf, self.llm)

        self.pending = {}
        self.ids = (f"{os.getpid()}-{n}" for n in itertools.count())
        self.loop = StaticLoop(build, self._respond)
        self.fingerprint = np.array([[self.llm.fingerprint.encode()]], dtype=np.object_)

    def finalize(self) -> None:
        self.loop.stop()
        pb_utils.Logger.log_info("static llm: unloaded")
