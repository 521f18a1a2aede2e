"""Errors in each API's shape + HTTP status.

    OpenAI (chat, completions, responses, everything else):
        {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages and below):
        {"type": "error", "error": {"type": "invalid_request_error", "message"}}
        type by status: 400 invalid_request_error, 401 authentication_error, 403
        permission_error, 404 not_found_error, 413 request_too_large, 429 rate_limit_error,
        500/502 api_error, 503 overloaded_error, 504 timeout_error; the field at fault (OpenAI's
        `param`) is named at the end of the message

`GatewayError` is raised anywhere below the HTTP layer; the same object maps onto a gRPC status
for the gRPC front, onto either body (`error_body_for(path, ...)`), and onto an SSE error
event once a stream has started.
"""
from __future__ import annotations

import json
from http import HTTPStatus

import grpc

from baton.request_limits import RequestError  # noqa: F401  (re-exported: the gateway's)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error"}

_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
               504: grpc.StatusCode.DEADLINE_EXCEEDED}


class GatewayError(Exception):
    """A request failed with an HTTP `status`. retry_after: seconds, sent as Retry-After."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __reduce__(self):  # pickled across the preparation pool (gateway/prep_pool.py)
        return _gateway_error, (self.status, self.message, self.param, self.code,
                                self.retry_after)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)


def _gateway_error(status: int, message: str, param: str | None, code: str | None,
                   retry_after: float | None) -> GatewayError:
    return GatewayError(status, message, param=param, code=code, retry_after=retry_after)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """Anthropic's error body (see the module docstring)."""
    if param and param not in message:
        message = f"{message} ({param})"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}


def is_anthropic(path: str) -> bool:
    """Whether `path` is served in Anthropic's shapes (/v1/messages and below)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_body_for(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> dict:
    """The error body in the shape of the API `path` belongs to."""
    if is_anthropic(path):
        return anthropic_error_body(status, message, param)
    return error_body(status, message, param, code)


DONE = b"data: [DONE]\n\n"  # the last event of every SSE stream


def sse_error(error: GatewayError) -> bytes:
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


def error_code_of(event: bytes) -> str:
    """The `code` (else the status, else "error") of an SSE event carrying an OpenAI or an
    Anthropic error body, for the metrics."""
    data = event[event.index(b"data: ") + 6:] if b"data: " in event else b"{}"
    try:
        body = json.loads(data)
    except ValueError:
        return "error"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = body.get("response", {}).get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "error"
    return str(error.get("code") or error.get("type") or "error")


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def require_model(model: str | None, served: set[str]) -> None:
    """GatewayError 404 (OpenAI's model_not_found) unless `model` names the served model;
    None (allowed by /tokenize and /detokenize) means the served model."""
    if model is not None and model not in served:
        raise GatewayError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
