"""Triton glue for ``preprocess``: tensors in, ``preprocess.Preprocessor`` does the work, tensors out."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import InvalidInput
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from triton_glue.params import read_parameters
from triton_glue.tensors import error_response, response, scalar


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = read_parameters(json.loads(args["model_config"]), PreprocessConfig)
        self.preprocessor = Preprocessor(config)
        self.fingerprint = np.array([[self.preprocessor.fingerprint]], dtype=np.object_)
        pb_utils.Logger.log_info(
            f"preprocess: tokenizer {config.tokenizer_dir} (vocab fingerprint {self.preprocessor.fingerprint})"
        )

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _respond(self, request) -> "pb_utils.InferenceResponse":
        try:
            template = scalar(request, "apply_chat_template")
            ids = self.preprocessor.encode(PromptRequest(
                scalar(request, "text_input"), scalar(request, "system_prompt"),
                True if template is None else bool(template), scalar(request, "messages"),
            ))
        except InvalidInput as e:
            return error_response(e)
        return response(input_ids=np.array([ids], dtype=np.int32), tokenizer_fingerprint=self.fingerprint)
