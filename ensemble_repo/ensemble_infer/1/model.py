"""Triton glue for ``ensemble_infer``: the KServe ``infer`` path (HTTP and gRPC unary) to ``ensemble``.

Triton refuses ``infer`` on decoupled models, and ``ensemble`` is decoupled because ``llm`` streams. This
model is not decoupled: each request becomes one non-streaming BLS call to ``ensemble`` on a worker
thread, and its one response goes back through the response sender, so ``execute`` returns at once and
requests still join llm's running batch individually.
"""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from serving.errors import CANCELLED, INTERNAL_ERROR, OVERLOADED

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str) -> "pb_utils.TritonError":
    """The ensemble's error with its code back: BLS keeps only the message, which says which it was."""
    if INTERNAL_ERROR in message:
        return pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
    if OVERLOADED in message or "Exceeds maximum queue size" in message:  # llm's or Triton's queue is full
        return pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
    if CANCELLED in message:
        return pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED)
    return pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        self.max_in_flight = int(config["parameters"]["max_in_flight"]["string_value"])
        self.workers = ThreadPoolExecutor(max_workers=self.max_in_flight)
        self.in_flight = 0  # a full pool would queue without bound; past max_in_flight, refuse instead
        self.lock = threading.Lock()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            with self.lock:
                full = self.in_flight >= self.max_in_flight
                self.in_flight += not full
            if full:
                message = f"{OVERLOADED}{self.max_in_flight} infer requests are in flight (max_in_flight); retry later"
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_error(message)), flags=FINAL)
                continue
            # Copies: a request's own tensors are released when execute returns.
            tensors = (pb_utils.get_input_tensor_by_name(request, n) for n in self.inputs)
            inputs = [pb_utils.Tensor(t.name(), t.as_numpy().copy()) for t in tensors if t is not None]
            self.workers.submit(self._answer, sender, inputs)
        return None

    def _answer(self, sender, inputs: list) -> None:
        try:
            reply = self._call(inputs)
        except Exception as e:  # a failed BLS call must still answer its client
            reply = pb_utils.InferenceResponse(output_tensors=[], error=_error(f"{INTERNAL_ERROR}{e}"))
        finally:
            with self.lock:
                self.in_flight -= 1
        sender.send(reply, flags=FINAL)

    def _call(self, inputs: list) -> "pb_utils.InferenceResponse":
        call = pb_utils.InferenceRequest(model_name="ensemble", requested_output_names=self.outputs, inputs=inputs)
        reply = None
        for response in call.exec(decoupled=True):
            if response.has_error():
                reply = pb_utils.InferenceResponse(output_tensors=[], error=_error(response.error().message()))
            elif response.output_tensors():
                reply = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
        if reply is None:
            reply = pb_utils.InferenceResponse(
                output_tensors=[], error=_error(INTERNAL_ERROR + "ensemble returned no response")
            )
        return reply

    def finalize(self) -> None:
        self.workers.shutdown(wait=True)
