"""Triton glue for ``postprocess``: generated ids in, ``postprocess.Detokenizer`` does the work, text out."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from postprocess import Detokenizer, PostprocessConfig
from serving.errors import InvalidInput, decode_utf8
from serving.glue import error_response, response, scalar, single
from serving.params import read_parameters


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = read_parameters(json.loads(args["model_config"]), PostprocessConfig)
        self.detokenizer = Detokenizer(config)
        pb_utils.Logger.log_info(
            f"postprocess: tokenizer {config.tokenizer_dir} (vocab fingerprint {self.detokenizer.fingerprint})"
        )

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _respond(self, request) -> "pb_utils.InferenceResponse":
        try:
            ids = single(request, "output_ids")
            fingerprint = scalar(request, "tokenizer_fingerprint")
            if ids is None or fingerprint is None:
                raise InvalidInput("output_ids and tokenizer_fingerprint are required")
            text = self.detokenizer.decode(ids.tolist(), decode_utf8("tokenizer_fingerprint", fingerprint))
        except InvalidInput as e:
            return error_response(e)
        return response(
            text_output=np.array([[text.encode("utf-8")]], dtype=np.object_),
            completion_tokens=np.array([[len(ids)]], dtype=np.int32),
        )
