"""Tensor <-> Python conversion shared by the ``model.py`` files. Importable only inside a Python stub."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import InvalidInput, classify

# The code each kind of pipeline message travels with (contract.errors.classify).
CODES = {"internal": "INTERNAL", "overloaded": "UNAVAILABLE", "unavailable": "UNAVAILABLE", "cancelled": "CANCELLED",
         "invalid": "INVALID_ARG"}


_last: tuple[object, dict] = (None, {})  # the request last read, and its inputs by name


def _inputs(request: "pb_utils.InferenceRequest") -> dict:
    """``request``'s input tensors by name, made once per request: python_backend's own
    ``get_input_tensor_by_name`` builds every input's object again for each name it looks up, and a
    postprocess call reads about twenty (a tenth of its time per response, measured). A model's
    ``execute`` reads one request at a time on its one thread, so the last request's are all it keeps."""
    global _last
    if _last[0] is not request:
        _last = (request, {tensor.name(): tensor for tensor in request.inputs()})
    return _last[1]


def single(request: "pb_utils.InferenceRequest", name: str) -> np.ndarray | None:
    """The one row of input ``name`` (None when an optional input is absent).

    Each request carries one prompt; a client-side batch dimension other than 1 is refused clearly
    instead of being half-served.
    """
    tensor = _inputs(request).get(name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.shape[0] != 1:
        raise InvalidInput(f"{name} has batch dimension {array.shape[0]}; send one prompt per request (1)")
    return array[0]


def scalar(request: "pb_utils.InferenceRequest", name: str):
    """The single element of a ``dims: [ 1 ]`` input, as a Python value, or None when absent."""
    row = single(request, name)
    if row is None:
        return None
    if row.size != 1:
        raise InvalidInput(f"{name} must hold exactly one value, got {row.size}")
    return row.item()


def error_response(error: Exception, code: int | None = None) -> "pb_utils.InferenceResponse":
    """A per-request error: the rest of the batch is answered normally."""
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(error), code))


def triton_error(message: str) -> "pb_utils.TritonError":
    """A pipeline error with the code its message implies (``CODES``): BLS keeps only the message."""
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, CODES[classify(message)]))


def failure(message: str) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message))


def response(**outputs: np.ndarray) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])
