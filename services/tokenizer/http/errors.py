"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any

from himamba.common.messages import ErrorReply

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


_KNOWN_STATUS = {400, 404, 409, 500, 503}  # engine refusals passed on as they are; others: 500


class ApiError(Exception):
    """A request the HTTP front door answers with an error status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def param_of_message(message: str) -> str | None:
    """The field a validation message names first ("max_tokens must be ..." -> "max_tokens")."""
    head = message.split(" ", 1)[0].rstrip(":").split("[", 1)[0]
    if head and head.replace("_", "").isalnum() and head.islower():
        return head
    return None


def reply_error(reply: ErrorReply) -> ApiError:
    """The HTTP error of an engine refusal or failure."""
    status = reply.code if reply.code in _KNOWN_STATUS else 500
    param = param_of_message(reply.message) if status == 400 else None
    return ApiError(status, reply.message, param=param)
