"""Triton glue for ``ensemble_infer``: the KServe ``infer`` path (HTTP and gRPC unary) to ``ensemble``.

Triton refuses ``infer`` on decoupled models, and ``ensemble`` is decoupled because ``llm`` streams. This
model is not decoupled: each request becomes one non-streaming BLS call to ``ensemble`` on a thread of
its own, and its one response goes back through the response sender, so ``execute`` returns at once and
requests still join llm's running batch individually.

If llm's stub dies, Triton 2.51 never answers the calls it held (``ipc/stubs.py``); a guard thread
notices within two seconds and answers them with a clear error, and the stranded threads are left behind.
"""

import json
import os
import threading

import triton_python_backend_utils as pb_utils

from contract.errors import INTERNAL_ERROR, OVERLOADED
from triton_glue.inflight import InFlight
from ipc.stubs import DeathWatch
from triton_glue.tensors import failure

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
GUARD_SECONDS = 1.0


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        parameters = config["parameters"]
        # Past max_in_flight, refuse: a thread each, and a call stranded by a dead stub never returns.
        self.in_flight = InFlight(int(parameters["max_in_flight"]["string_value"]))
        # The tritonserver that launched this stub launched llm's too.
        self.deaths = DeathWatch(parameters["guarded_models"]["string_value"].split(","), os.getppid())
        # A family must outlive its metric.
        self.stranded_family = pb_utils.MetricFamily(
            name="ensemble_infer_stranded_calls_total", kind=pb_utils.MetricFamily.COUNTER,
            description="infer calls in flight when a guarded stub died, answered by the guard; those the dead "
                        "stub held keep a Python backend thread (thread-pool-size) until the server restarts")
        self.stranded = self.stranded_family.Metric(labels={"model": args["model_name"], "version": args["model_version"]})
        self.stopped = threading.Event()
        self.guard = threading.Thread(target=self._guard, name="ensemble_infer-guard", daemon=True)
        self.guard.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            ticket = self.in_flight.admit(sender)
            if ticket is None:
                message = f"{OVERLOADED}{self.in_flight.limit} infer requests are in flight (max_in_flight); retry later"
                sender.send(failure(message), flags=FINAL)
                continue
            # Copies: a request's own tensors are released when execute returns.
            tensors = (pb_utils.get_input_tensor_by_name(request, n) for n in self.inputs)
            inputs = [pb_utils.Tensor(t.name(), t.as_numpy().copy()) for t in tensors if t is not None]
            threading.Thread(target=self._answer, args=(ticket, inputs), daemon=True).start()
        return None

    def _answer(self, ticket: int, inputs: list) -> None:
        try:
            reply = self._call(inputs)
        except Exception as e:  # a failed BLS call must still answer its client
            reply = failure(f"{INTERNAL_ERROR}{e}")
        self._send(ticket, reply)

    def _send(self, ticket: int, reply: "pb_utils.InferenceResponse") -> None:
        sender = self.in_flight.finish(ticket)
        if sender is not None:  # else the guard answered it already
            sender.send(reply, flags=FINAL)

    def _guard(self) -> None:
        """Every second, look for a guarded model's stub that died. If one did, answer every request in
        flight: no telling which ones it held, and the rest are about to fail there or can be retried."""
        while not self.stopped.wait(GUARD_SECONDS):
            try:
                dead = self.deaths.look()
            except Exception as e:  # the guard must outlive a failed look
                pb_utils.Logger.log_warn(f"ensemble_infer guard: {e}")
                continue
            if not dead:
                continue
            model, tickets = sorted(dead)[0], self.in_flight.tickets()
            pb_utils.Logger.log_error(f"the Python stub of '{model}' died: answering {len(tickets)} infer requests in flight")
            message = f"the Python stub of '{model}' died with this request in flight; it was not completed: retry"
            for ticket in tickets:
                self._send(ticket, pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)))
            self.stranded.increment(len(tickets))

    def _call(self, inputs: list) -> "pb_utils.InferenceResponse":
        call = pb_utils.InferenceRequest(model_name="ensemble", requested_output_names=self.outputs, inputs=inputs)
        reply = None
        for response in call.exec(decoupled=True):
            if response.has_error():
                reply = failure(response.error().message())
            elif response.output_tensors():
                reply = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
        if reply is None:
            reply = failure(INTERNAL_ERROR + "ensemble returned no response")
        return reply

    def finalize(self) -> None:
        """Triton unloads this model only once every request has been answered; stranded threads stay."""
        self.stopped.set()
        self.guard.join()
