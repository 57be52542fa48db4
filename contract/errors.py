"""The one exception type that means "the client sent something wrong"."""


class InvalidInput(ValueError):
    """A client mistake; the message names the field, the value and the allowed range.

    Models turn it into a per-request ``TritonError.INVALID_ARG`` so batch-mates are unaffected.
    """


def decode_utf8(field: str, raw: bytes) -> str:
    """Strictly decode a ``TYPE_STRING`` element; invalid bytes are the client's error, not ours."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{field} is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}") from None


# Leads every message of a server-side failure. Triton 2.51's BLS hands a caller (ensemble_infer) the
# message of an error but not its code, so this is how it still tells a failure from a client mistake.
INTERNAL_ERROR = "internal error: "
CANCELLED = "request cancelled"
OVERLOADED = "overloaded: "  # leads a refusal for load (UNAVAILABLE): the client may retry later
UNAVAILABLE = "unavailable: "  # leads a refusal or an ending because the server is stopping: retry elsewhere
STOPPING = f"{UNAVAILABLE}the server is stopping and takes no new requests; retry"


def classify(message: str) -> str:
    """What an error from the pipeline was, from its message alone: ``internal``, ``overloaded``,
    ``unavailable``, ``cancelled`` or ``invalid`` (the client's mistake). Triton 2.51 hands BLS callers
    and gRPC stream clients the message of an error but not its code."""
    if INTERNAL_ERROR in message:
        return "internal"
    if OVERLOADED in message or "Exceeds maximum queue size" in message:  # llm's or Triton's queue is full
        return "overloaded"
    if UNAVAILABLE in message or "Server is stopping" in message:  # ours, or Triton's stopped scheduler
        return "unavailable"
    if CANCELLED in message:
        return "cancelled"
    return "invalid"
