"""The one place where pdserve's typed errors become gRPC status codes."""

from __future__ import annotations

import grpc

from engine.errors import CapacityError, InvalidRequestError, KVTransferError, WorkerFailedError


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, WorkerFailedError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, KVTransferError):
        return grpc.StatusCode.INTERNAL, f"KV transfer failed: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
