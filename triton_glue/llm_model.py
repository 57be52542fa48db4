"""Triton glue for ``llm`` (decoupled): ``execute`` validates and submits requests to the engine's port
(``llm.service.EngineLoop``); its updates come back as responses. What Triton needs of a request (its
response sender, and the request for the outputs that repeat it) stays here, in ``pending``."""

import itertools
import json
import os
from typing import NamedTuple

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from contract.errors import CANCELLED, INTERNAL_ERROR, OVERLOADED, STOPPING, UNAVAILABLE, InvalidInput, decode_utf8
from contract.schema import FinishReason, llm_fields
from llm import LLM, LLMConfig, configure_threads
from llm.compiles import COMPILATIONS, Progress
from llm.engine import Engine
from llm.request import GenerationRequest
from llm.scheduler import Overloaded
from llm.service import DrainDeadline, EngineLoop, Stopping, Update
from ipc import cancel, delivery, drain_notice
from triton_glue.metrics import TritonMetrics
from triton_glue.params import read_parameters
from triton_glue.tensors import error_response, failure, response, scalar, single

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# The request fields LLM.validate takes (contract/schema.py): a value each, or a list for a [-1] tensor.
FIELDS = tuple(f for f in llm_fields() if f.name != "stream")


class Pending(NamedTuple):
    """What the glue keeps of a request until its final update: where answers go, what it asked, and
    what preprocess decided that every response hands on (where the reply begins: contract/reasoning.py)."""

    sender: "pb_utils.InferenceResponseSender"
    request: GenerationRequest
    reasoning_state: np.ndarray


# What leads the message of each failed ending (contract/errors.py: the message carries its kind).
FAILURE_PREFIX = {FinishReason.ERROR: INTERNAL_ERROR, FinishReason.OVERLOADED: OVERLOADED,
                  FinishReason.UNAVAILABLE: UNAVAILABLE}


def _listed(row: np.ndarray | None) -> list | None:
    return None if row is None else row.tolist()


def _failure(update: Update) -> str:
    if update.finish_reason is FinishReason.CANCELLED:
        return CANCELLED
    return FAILURE_PREFIX[update.finish_reason] + (update.error or "")


def _logprobs(update: Update, k: int | None) -> dict[str, np.ndarray]:
    """The log-probabilities of the update's ids, a row per id: the id's own, then its top ``k``
    alternatives (and their ids). Zero columns when the request did not ask."""
    rows = update.logprobs or []
    values = np.array([[lp.logprob, *lp.top_logprobs] for lp in rows], dtype=np.float32).reshape(len(rows), -1 if rows else 0)
    ids = np.array([lp.top_ids for lp in rows], dtype=np.int32).reshape(len(rows), k or 0)
    return {"output_logprobs": values[None], "top_logprob_ids": ids[None]}


def _input_logprobs(update: Update, request: GenerationRequest) -> dict[str, np.ndarray]:
    """With ``prompt_logprobs``, in the first update: a row per prompt id, its log-probability (NaN for
    the first) then its alternatives', and its id then theirs. No rows otherwise."""
    k = request.prompt_logprobs
    if update.prompt_logprobs is None:
        return {"input_logprobs": np.zeros((1, 0, 0), np.float32), "input_logprob_ids": np.zeros((1, 0, 0), np.int32)}
    ids = request.input_ids
    values, top = np.full((len(ids), 1 + k), np.nan, np.float32), np.full((len(ids), 1 + k), -1, np.int32)
    top[:, 0] = ids
    for row, lp in enumerate(update.prompt_logprobs, start=1):
        values[row] = [lp.logprob, *lp.top_logprobs]
        top[row, 1:] = lp.top_ids
    return {"input_logprobs": values[None], "input_logprob_ids": top[None]}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        config = read_parameters(model_config, LLMConfig)
        gpu = args["model_instance_kind"] == "GPU"
        device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        instances = sum(group.get("count", 1) for group in model_config["instance_group"])
        metrics = TritonMetrics(args["model_name"], args["model_version"], config.kv_cache_tokens)

        def build():  # on the engine thread, where all of torch's work happens (llm/service.py says why)
            progress = Progress(pb_utils.Logger.log_info)
            try:
                if gpu:
                    torch.cuda.set_device(device)
                threads = configure_threads(instances, device)
                progress.phase(f"loading {config.model_dir} on {device}")
                self.llm = LLM(config, device)
                engine = self.engine(metrics, progress)
            except BaseException:
                progress.close("failed")
                raise
            runner = engine.runner
            progress.close(f"ready: {COMPILATIONS.count} compilations, {len(runner.warmed)} step shapes run, "
                           f"{runner.cuda_graphs} captured as CUDA graphs")
            metrics.loaded(runner.cuda_graphs, self.llm.weight_bytes)
            pb_utils.Logger.log_info(
                f"llm: {config.model_dir} on {device} as {self.llm.dtype} ({self.llm.kernels}), weights {self.llm.weights} from {self.llm.source}: "
                f"{self.llm.weight_bytes / 2**20:.0f} MiB read a step, {threads} threads, "
                f"{'compiled' if config.compile else 'eager'}, vocabulary {self.llm.vocab_size}, "
                f"context {self.llm.context_tokens} tokens, KV budget {config.kv_cache_tokens} tokens x "
                f"{self.llm.kv_bytes_per_token} bytes = {config.kv_cache_tokens * self.llm.kv_bytes_per_token / 2**20:.0f} MiB, "
                f"up to {config.max_running_requests} running requests and {config.max_batched_tokens} tokens a step, "
                f"streamed {config.stream_interval} token{'s' if config.stream_interval > 1 else ''} at a time"
            )
            return engine

        self.server_pid = os.getppid()  # the tritonserver that started this stub
        cancel.sweep()
        delivery.sweep()
        self.board = delivery.Board()
        self.pending: dict[str, Pending] = {}  # by generation id: "<pid>-<n>", unique on the host
        self.ids = (f"{os.getpid()}-{n}" for n in itertools.count())
        self.loop = EngineLoop(build, self._respond, self._poll, pb_utils.Logger.log_error, self._draining, self._drained,
                               config.stream_interval, self.board)
        self.fingerprint = np.array([[self.llm.fingerprint.encode()]], dtype=np.object_)

    def engine(self, metrics: TritonMetrics, progress: Progress) -> Engine:
        """The engine this instance serves, on the engine thread: the model's (the benchmark's stand-in,
        bench/standin_model.py, serves another)."""
        return self.llm.engine(metrics, progress)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                generation, every_token = self._validate(request), bool(scalar(request, "stream"))
                state, coalesce = scalar(request, "reasoning_state") or b"", bool(scalar(request, "coalesce"))
            except InvalidInput as e:
                sender.send(error_response(e), flags=FINAL)
                continue
            key = next(self.ids)
            self.pending[key] = Pending(sender, generation, np.array([[state]], dtype=np.object_))
            try:
                self.loop.submit(generation, key, every_token, coalesce)
            except InvalidInput as e:
                del self.pending[key]
                sender.send(error_response(e), flags=FINAL)
            except (Overloaded, Stopping) as e:
                del self.pending[key]
                sender.send(failure(OVERLOADED + str(e) if isinstance(e, Overloaded) else STOPPING), flags=FINAL)
        return None

    def _validate(self, request) -> GenerationRequest:
        ids = single(request, "input_ids")
        if ids is None:
            raise InvalidInput("input_ids is required")
        fingerprint = scalar(request, "tokenizer_fingerprint")
        values = {f.name: scalar(request, f.name) if f.dims == (1,) else _listed(single(request, f.name)) for f in FIELDS}
        return self.llm.validate(
            ids.tolist(), **values,
            tokenizer_fingerprint=None if fingerprint is None else decode_utf8("tokenizer_fingerprint", fingerprint),
        )

    def _poll(self) -> None:
        """On the responder thread: cancel the requests whose clients went away (Triton says so) or whose
        stream postprocess ended (the cancel board, ``ipc/cancel.py``)."""
        for key in self.loop.keys():
            pending = self.pending.get(key)
            if pending is not None and pending.sender.is_cancelled():
                self.loop.cancel(key)
                continue
            error = cancel.take(key)
            if error is not None:
                self.loop.cancel(key, FinishReason.ERROR if error else FinishReason.CANCELLED, error or None)

    def _draining(self) -> DrainDeadline | None:
        notice = drain_notice.notice(self.server_pid)
        return None if notice is None else DrainDeadline(notice.deadline, notice.seconds)

    def _drained(self) -> None:
        drain_notice.done(os.getpid())
        pb_utils.Logger.log_info("llm: drained: every request taken has had its final answer")

    def _respond(self, update: Update) -> None:
        """The responder thread's answer: the ids postprocess needs to turn the new ones into text, or an
        error.

        A failure is llm's own error response only while nothing was sent: after that, postprocess steps
        of this request may still be in flight, and Triton 2.51's ensemble never finishes a request whose
        step fails while another step runs (its in-flight count never returns to 0; fixed in later
        Triton). So a failure mid-stream travels as a final response carrying ``error``, and postprocess,
        the last step, answers with it."""
        sender, request, reasoning_state = self.pending[update.key]
        finished = update.finish_reason is not None
        if finished:
            del self.pending[update.key]  # whether or not the send below succeeds: nothing follows a final update
        if update.failed and update.first:
            sender.send(failure(_failure(update)), flags=FINAL)
        else:
            sender.send(response(
                output_ids=np.array([update.ids], dtype=np.int32),
                sent_tokens=np.array([[update.sent_tokens]], dtype=np.int32),
                completion_tokens=np.array([[update.completion_tokens]], dtype=np.int32),
                prompt_tokens=np.array([[len(request.input_ids)]], dtype=np.int32),
                cached_tokens=np.array([[update.cached_tokens]], dtype=np.int32),
                finish_reason=np.array([[update.finish_reason.value.encode() if finished else b""]], dtype=np.object_),
                tokenizer_fingerprint=self.fingerprint,
                stop=np.array([[s.encode() for s in request.stop]], dtype=np.object_).reshape(1, -1),
                stop_after=np.array([[update.stop_after]], dtype=np.int32),
                generation_id=np.array([[update.key.encode()]], dtype=np.object_),
                error=np.array([[_failure(update).encode() if update.failed else b""]], dtype=np.object_),
                **_logprobs(update, request.top_logprobs),
                **_input_logprobs(update, request),
                reasoning_state=reasoning_state,
            ), flags=FINAL if finished else 0)

    def finalize(self) -> None:
        self.loop.stop()
        self.board.close()
