"""The one place where errors become gRPC status codes and messages.

Client mistakes keep their message, which names the field: INVALID_ARGUMENT (bad input),
ALREADY_EXISTS (a request_id already live), RESOURCE_EXHAUSTED (a limit or no capacity),
UNAVAILABLE naming the stop (the server drains before it shuts down).
Everything else is ours: the client gets a short message with a reference to grep the router's
log for (UNAVAILABLE, naming the cause in the router's own words, when no worker could serve
the request; INTERNAL otherwise), and the full error, a worker's exception text or stack
included, goes to that log only. Never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from ray.exceptions import RayTaskError

from engine.errors import CapacityError, InvalidRequestError, WorkerFailedError
from router.failure_log import FailureLog
from router.identity import DuplicateRequestError, ShuttingDownError

logger = logging.getLogger(__name__)
failure_log = FailureLog(logger)   # one line per distinct failure per window (a flood otherwise)


class RequestFailedError(Exception):
    """A worker finished the request with FinishReason.ERROR; ``detail`` is its text (logged only)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def status_for(exc: BaseException, req_id: str = "") -> tuple[grpc.StatusCode, str]:
    exc = unwrap(exc)
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}"
    if isinstance(exc, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, ShuttingDownError):   # expected at every stop: the client's to retry elsewhere
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, WorkerFailedError):   # our own words (the cause: which worker, what limit)
        return grpc.StatusCode.UNAVAILABLE, _logged(f"unavailable: {exc}", exc, req_id)
    return grpc.StatusCode.INTERNAL, _logged("internal error", exc, req_id)


# Endings that are not the server's failure: the client's mistake or its own label reused, a
# refusal under load, the drain at a stop (each answered by its own status above), the client
# leaving (a cancel, or its stream closed).
_NOT_OURS = (InvalidRequestError, DuplicateRequestError, CapacityError, ShuttingDownError,
             asyncio.CancelledError, GeneratorExit)


def fault_of(exc: BaseException | None) -> BaseException | None:
    """``exc`` where a request that ended with it failed by the server's fault (what a trace span
    records as its error, as OpenTelemetry's conventions mark a 5xx), else None."""
    return exc if exc is not None and not isinstance(unwrap(exc), _NOT_OURS) else None


def retry_after_s(exc: BaseException) -> float | None:
    """The client's hint when to send a refused request again (HTTP ``Retry-After``, gRPC's
    ``grpc-retry-pushback-ms``): capacity refusals only; None for everything else."""
    exc = unwrap(exc)
    return exc.retry_after_s if isinstance(exc, CapacityError) else None


def unwrap(exc: BaseException) -> BaseException:
    """A typed error raised in a worker reaches us as a RayTaskError carrying it as ``cause``
    (whose own text is the worker's traceback): map and word it by the cause."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def _logged(what: str, exc: BaseException, req_id: str) -> str:
    detail = exc.detail if isinstance(exc, RequestFailedError) else f"{type(exc).__name__}: {exc}"
    if str(exc) and str(exc) in what:   # "unavailable: <its text>": the text once in the line
        detail = type(exc).__name__
    # A worker's failure (RequestFailedError) and a loss the router could not move past
    # (WorkerFailedError: which worker, what limit) are said in full by their text: a stack of the
    # router's own generators per request adds nothing but lines (a probe: 8 requests failing on
    # a killed worker logged 400 traceback lines). Anything else is unexpected: its stack helps.
    expected = isinstance(exc, (RequestFailedError, WorkerFailedError))
    ref = failure_log.record(what, detail, req_id, exc_info=None if expected else exc)
    return f"{what} (ref {ref}); see router logs"
