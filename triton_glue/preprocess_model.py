"""Triton glue for ``preprocess``: tensors in, ``preprocess.Preprocessor`` does the work, tensors out."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import STOPPING, InvalidInput
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from ipc import drain_notice
from triton_glue.params import read_parameters
from triton_glue.tensors import error_response, failure, response, scalar


COALESCE = np.array([[True]])  # in the ensemble, postprocess reports each response to llm (ipc/delivery.py)
TEXTS = ("text_input", "system_prompt", "messages", "structured_outputs", "tools", "tool_choice", "chat_template_kwargs")  # raw bytes, as sent


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = read_parameters(json.loads(args["model_config"]), PreprocessConfig)
        self.preprocessor = Preprocessor(config)
        self.fingerprint = np.array([[self.preprocessor.fingerprint]], dtype=np.object_)
        self.server_pid = os.getppid()  # the tritonserver that started this stub
        pb_utils.Logger.log_info(
            f"preprocess: tokenizer {config.tokenizer_dir} (vocab fingerprint {self.preprocessor.fingerprint}); "
            f"{self.preprocessor.template_tools}; {'a thinking' if self.preprocessor.thinks else 'no thinking'} template"
        )

    def execute(self, requests: list) -> list:
        """Each request's ids, or, once the server drains (``ipc/drain_notice.py``), a refusal: the first
        step is where a new request is turned away while those already taken finish."""
        if drain_notice.notice(self.server_pid) is not None:
            return [failure(STOPPING) for _ in requests]
        return [self._respond(request) for request in requests]

    def _respond(self, request) -> "pb_utils.InferenceResponse":
        try:
            flags = {name: scalar(request, name) for name in ("apply_chat_template", "parallel_tool_calls")}
            prepared = self.preprocessor.encode(PromptRequest(
                **{name: scalar(request, name) for name in TEXTS},
                **{name: bool(value) for name, value in flags.items() if value is not None},
            ))
        except InvalidInput as e:
            return error_response(e)
        return response(input_ids=np.array([prepared.input_ids], dtype=np.int32), tokenizer_fingerprint=self.fingerprint,
                        structured_outputs=np.array([[prepared.structured_outputs]], dtype=np.object_),
                        reasoning_state=np.array([[prepared.reasoning_state.encode()]], dtype=np.object_),
                        coalesce=COALESCE)
