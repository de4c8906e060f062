"""Bearer-token authentication for the router's gRPC services, as a grpc.aio interceptor (the
HTTP API checks its ``Authorization`` header with the same ``check_bearer``).

Life cycle of one call: the interceptor looks up the method's handler, then checks the call's
``authorization`` metadata against the configured token. An open service (grpc.health.v1: load
balancers and orchestrators probe it without credentials) and an authorized call get the real
handler; any other call gets a handler of the same shape that ends it with UNAUTHENTICATED
before the request is read, so nothing reaches the servicer, the tokenizer or the workers.

The comparison is ``hmac.compare_digest`` on bytes: its time does not depend on where a wrong
token first differs, so the token cannot be guessed byte by byte from response times.
"""

from __future__ import annotations

import enum
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2

logger = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # grpc.health.v1.Health
_SCHEME = "bearer"


class AuthResult(enum.Enum):
    OPEN = "open"          # the service needs no token
    GRANTED = "granted"
    MISSING = "missing"    # no authorization metadata, or not a bearer token
    WRONG = "wrong"

    @property
    def allowed(self) -> bool:
        return self in (AuthResult.OPEN, AuthResult.GRANTED)


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, open_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        if not token:
            raise ValueError("empty auth token")
        self._token = token.encode()
        self._open = tuple(f"/{name}/" for name in open_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        result = self.check(details.method, details.invocation_metadata)
        if handler is None or result.allowed:
            return handler  # None: an unknown method, which gRPC answers UNIMPLEMENTED
        logger.debug("refused %s: %s token", details.method, result.value)
        return _refusal(handler, f"{result.value} bearer token (metadata 'authorization: Bearer <token>')")

    def check(self, method: str, metadata) -> AuthResult:
        if method.startswith(self._open):
            return AuthResult.OPEN
        return check_bearer(self._token, metadata)


def check_bearer(token: bytes, metadata) -> AuthResult:
    """``metadata``'s bearer token against ``token``: the one rule, for gRPC metadata and HTTP
    headers alike (``(key, value)`` pairs, keys lower-case)."""
    presented = _bearer(metadata)
    if presented is None:
        return AuthResult.MISSING
    return AuthResult.GRANTED if hmac.compare_digest(presented, token) else AuthResult.WRONG


def _bearer(metadata) -> bytes | None:
    """The token of the first ``authorization: Bearer ...`` entry, or None."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == _SCHEME and token.strip():
            return token.strip().encode()
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler shaped like ``handler`` (so the client sees a clean status, not a protocol
    error) that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(refuse, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)
