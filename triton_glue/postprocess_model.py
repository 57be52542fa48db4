"""Triton glue for ``postprocess``: one llm response in, ``postprocess.Detokenizer`` does the work, text out.

An error answers only a stream's last response (llm's final one): while llm still streams, a failed step
would leave Triton 2.51's ensemble unable to finish the request (``triton_glue/llm_model.py``). Earlier
ones hand a cancellation or a failure to llm through the cancel board and answer with no text; llm then
ends the stream, and its final response brings the error back here.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import CANCELLED, InvalidInput, decode_utf8
from postprocess import LLMResponse, Detokenizer, PostprocessConfig
from ipc import cancel, delivery
from triton_glue.params import read_parameters
from triton_glue.tensors import error_response, failure, response, scalar, single


def _chunk(request, text: str, token_logprobs: bytes, finish_reason: bytes,
           prompt_token_logprobs: bytes = b"", stop_reason: str = "") -> "pb_utils.InferenceResponse":
    return response(
        text_output=np.array([[text.encode("utf-8")]], dtype=np.object_),
        token_logprobs=np.array([[token_logprobs]], dtype=np.object_),
        prompt_token_logprobs=np.array([[prompt_token_logprobs]], dtype=np.object_),
        completion_tokens=np.array([[scalar(request, "completion_tokens") or 0]], dtype=np.int32),
        prompt_tokens=np.array([[scalar(request, "prompt_tokens") or 0]], dtype=np.int32),
        cached_tokens=np.array([[scalar(request, "cached_tokens") or 0]], dtype=np.int32),
        finish_reason=np.array([[finish_reason]], dtype=np.object_),
        stop_reason=np.array([[stop_reason.encode("utf-8")]], dtype=np.object_),
        reasoning_state=np.array([[scalar(request, "reasoning_state") or b""]], dtype=np.object_),
    )


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = read_parameters(json.loads(args["model_config"]), PostprocessConfig)
        self.detokenizer = Detokenizer(config)
        self.marker = delivery.Marker()
        pb_utils.Logger.log_info(
            f"postprocess: tokenizer {config.tokenizer_dir} (vocab fingerprint {self.detokenizer.fingerprint})"
        )

    def execute(self, requests: list) -> list:
        responses = [self._respond(request) for request in requests]
        for request in requests:  # llm sends a stream's next tokens once its last response is through here
            self._delivered(request)
        return responses

    def _delivered(self, request) -> None:
        try:
            generation_id, tokens = scalar(request, "generation_id"), scalar(request, "completion_tokens")
        except InvalidInput:
            return
        if generation_id is not None and tokens is not None:
            self.marker.mark(generation_id.decode("utf-8", "replace"), int(tokens))

    def _respond(self, request) -> "pb_utils.InferenceResponse":
        try:
            error, generation_id = scalar(request, "error"), scalar(request, "generation_id")
            # An earlier response of a stream llm still runs (a client calling postprocess itself sends no id).
            streaming = generation_id is not None and not scalar(request, "finish_reason")
        except InvalidInput as e:
            return error_response(e)
        if error:
            return failure(error.decode("utf-8", "replace"))
        if request.is_cancelled():
            return self._hand_to_llm(request, generation_id) if streaming else failure(CANCELLED)
        try:
            return self._text(request)
        except InvalidInput as e:
            return self._hand_to_llm(request, generation_id, str(e)) if streaming else error_response(e)

    def _hand_to_llm(self, request, generation_id: bytes, error: str = "") -> "pb_utils.InferenceResponse":
        """Ask llm to end this stream (with ``error``, or as cancelled); the response adds no text."""
        cancel.mark(generation_id.decode("utf-8", "replace"), error)
        return _chunk(request, "", b"", b"")

    def _text(self, request) -> "pb_utils.InferenceResponse":
        ids = single(request, "output_ids")
        fingerprint = scalar(request, "tokenizer_fingerprint")
        if ids is None or fingerprint is None:
            raise InvalidInput("output_ids and tokenizer_fingerprint are required")
        self.detokenizer.check(decode_utf8("tokenizer_fingerprint", fingerprint))
        finish_reason = scalar(request, "finish_reason") or b""
        stop = single(request, "stop")
        logprobs, top_ids = single(request, "output_logprobs"), single(request, "top_logprob_ids")
        asked = logprobs is not None and top_ids is not None and logprobs.shape[-1] > 0
        delta = self.detokenizer.delta(LLMResponse(
            ids.tolist(), scalar(request, "sent_tokens") or 0, finished=bool(finish_reason),
            stop=() if stop is None else tuple(decode_utf8("stop", s) for s in stop),
            stop_after=int(scalar(request, "stop_after") or 0),
            logprobs=logprobs.tolist() if asked else None, top_ids=top_ids.tolist() if asked else None,
        ))
        token_logprobs = b"" if delta.logprobs is None else json.dumps(delta.logprobs).encode()
        prompt_values, prompt_rows = single(request, "input_logprobs"), single(request, "input_logprob_ids")
        prompt = b""
        if prompt_values is not None and prompt_rows is not None and prompt_rows.shape[0] > 0:
            prompt = json.dumps(self.detokenizer.prompt_entries(prompt_values.tolist(), prompt_rows.tolist())).encode()
        return _chunk(request, delta.text, token_logprobs, finish_reason, prompt, delta.stop_reason)
