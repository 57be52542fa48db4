"""Triton glue for ``llm``: one ``llm.Generator`` per instance; each batch is validated, then generated."""

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from llm import Generator, LLMConfig, configure_threads
from serving.errors import InvalidInput
from serving.glue import error_response, response, scalar, single
from serving.params import read_parameters


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        config = read_parameters(model_config, LLMConfig)
        gpu = args["model_instance_kind"] == "GPU"
        device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        if gpu:
            torch.cuda.set_device(device)
        instances = sum(group.get("count", 1) for group in model_config["instance_group"])
        threads = configure_threads(instances, device)
        self.generator = Generator(config, device)
        pb_utils.Logger.log_info(
            f"llm: {config.model_dir} on {device} as {self.generator.model.dtype}, {threads} threads, "
            f"vocabulary {self.generator.vocab_size}, context {self.generator.context_tokens} tokens"
        )

    def execute(self, requests: list) -> list:
        responses = [None] * len(requests)
        valid = []
        for i, request in enumerate(requests):
            try:
                ids = single(request, "input_ids")
                if ids is None:
                    raise InvalidInput("input_ids is required")
                ignore_eos = bool(scalar(request, "ignore_eos"))
                valid.append((i, self.generator.validate(ids.tolist(), scalar(request, "max_tokens"), ignore_eos)))
            except InvalidInput as e:
                responses[i] = error_response(e)
        if valid:
            pb_utils.Logger.log_verbose(
                f"llm: batch of {len(valid)}, prompt lengths {[len(g.input_ids) for _, g in valid]}"
            )
            try:
                replies = self.generator.generate([g for _, g in valid])
            except RuntimeError as e:  # torch reports OOM and device errors this way; answer, don't crash
                pb_utils.Logger.log_error(f"llm: generation failed for a batch of {len(valid)}: {e}")
                replies = [e] * len(valid)
            for (i, _), reply in zip(valid, replies):
                if isinstance(reply, Exception):
                    responses[i] = error_response(reply, pb_utils.TritonError.INTERNAL)
                else:
                    responses[i] = response(output_ids=np.array([reply], dtype=np.int32))
        return responses
