"""The OpenAI API's errors: OpenAI's error object, its statuses and types, and the pipeline's errors in the
client's words."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from openai_frontend.schemas import Error, ErrorResponse
from openai_frontend.pipeline import PipelineError

RETRY_AFTER_SECONDS = 1
STATUS = {"invalid": 400, "overloaded": 503, "unavailable": 503, "internal": 500, "cancelled": 499, "timeout": 504}
# OpenAI's: every client mistake is an invalid_request_error (the code says which), a failure of ours a
# server_error; overload and a deadline keep names of their own, as vLLM's do.
ERROR_TYPES = {408: "timeout", 503: "service_unavailable", 504: "timeout"}
UNREAD_BODY = (408, 413)  # refused before the body was read whole: the connection closes, the rest unread
# Anthropic's error types by status (its Messages API, openai_frontend/messages.py).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def of(cls, error: PipelineError, names: dict[str, str]) -> "APIError":
        """The pipeline's error in the client's words: the field it names first (an input tensor, such as
        ``text_input``) becomes the one the client sent (``prompt``), and ``param``."""
        message, param = str(error), None
        field = re.match(r"[a-z_]+", message) if error.kind == "invalid" else None
        if field and field.group() in names:
            param = names[field.group()]
            message = param + message[field.end():]
        return cls(STATUS[error.kind], message, param, code=None if error.kind == "invalid" else error.kind)

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=Error(message=str(self), type=kind, param=self.param, code=self.code)).model_dump()

    def anthropic(self) -> dict:
        """The same error in Anthropic's shape."""
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": str(self)}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        """OpenAI's error object, or Anthropic's (on its Messages API's routes)."""
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 503 else {}
        if self.status in UNREAD_BODY:
            headers["Connection"] = "close"
        return JSONResponse(self.anthropic() if anthropic else self.body(), status_code=self.status, headers=headers)


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""
