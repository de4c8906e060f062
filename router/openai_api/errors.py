"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the usual
HTTP status. The words and the decision which kind of error it is come from ``router.errors``
(``GenerationCore.failure``): this module only maps its gRPC status to HTTP, once.

  400 invalid_request_error   bad input (``param`` names the OpenAI parameter)
  401 authentication_error    missing or wrong bearer token
  404 not_found_error         an unknown model or path
  408 invalid_request_error   a body that did not arrive within ``--http-receive-timeout-s``
  409 conflict_error          an ``X-Request-Id`` already live (gRPC: ALREADY_EXISTS)
  413 invalid_request_error   a body over ``--max-receive-message-bytes``
  429 rate_limit_error        admission refused it (the message carries the predicted TTFT),
                              or a load limit (concurrent streams, the admission queue)
  503 service_unavailable     no worker can serve it (the cause in the router's words)
  500 internal_error          ours; the message carries a reference to grep the router's log for
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc

from engine.errors import InvalidRequestError
from router.errors import retry_after_s, unwrap
from router.identity import DuplicateRequestError

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.INTERNAL: (500, "internal_error"),
}


@dataclass(eq=False)   # an exception: neither frozen nor slotted (Python sets its traceback)
class ApiError(Exception):
    """An error on its way to an HTTP client."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None   # a refusal's hint when to send it again

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, RFC 9110) and ``retry-after-ms`` (OpenAI's SDKs read
        it first) on a refusal; none otherwise."""
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(math.ceil(self.retry_after_s)), "retry-after-ms": str(round(self.retry_after_s * 1000))}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def from_status(code: grpc.StatusCode, message: str, exc: BaseException | None = None, param_for=None) -> ApiError:
    """``router.errors``' verdict as an ``ApiError``. A bad-input error's message is reworded with
    the OpenAI parameter (``param_for`` maps a GenerateRequest field path to it)."""
    status, kind = _HTTP.get(code, (500, "internal_error"))
    cause = unwrap(exc) if exc is not None else None
    param = None
    if isinstance(cause, InvalidRequestError):
        param = param_for(cause.field) if param_for else cause.field
        message = f"{param}: {cause.message}"
    elif isinstance(cause, DuplicateRequestError):
        param = "request_id"   # the X-Request-Id header's (or the body's) label, already live
    return ApiError(status, message, kind, param, code.name.lower(), retry_after_s(exc) if exc is not None else None)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None) -> ApiError:
    return ApiError(404, message, "not_found_error", param, "model_not_found" if param == "model" else "not_found")


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body is over {limit} bytes (max_receive_message_bytes)",
                    "invalid_request_error", None, "request_too_large")


def body_timeout(timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {timeout_s:g} s (http_receive_timeout_s)",
                    "invalid_request_error", None, "request_timeout")
