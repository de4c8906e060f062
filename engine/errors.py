"""Typed errors raised by the engine and the workers; the router maps each to one gRPC code.
``ConfigError`` is a configuration's, refused before anything starts (``pdserve``: a usage error)."""

from __future__ import annotations

import string
from collections.abc import Callable


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT). ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # Ray re-raises it in the caller: it must unpickle with its fields
        return (type(self), (self.field, self.message))


def require(ok: object, field: str, message: str) -> None:
    """Raise InvalidRequestError(field, message) unless ``ok``: every request check's one form."""
    if not ok:
        raise InvalidRequestError(field, message)


class ConfigError(PdserveError, ValueError):
    """A configuration value no cluster could serve with. ``template`` marks each field it names
    as ``{field}``: in-process it reads with the field's name (``num_decode must be >= 1``),
    and ``pdserve`` says it with the flag that sets the field (``said``: ``--num-decode must be
    >= 1``), one rule for every config (cluster, engine, limits, tracing, client TLS)."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.said())

    @classmethod
    def on(cls, field: str, text: str) -> ConfigError:
        """``field`` then ``text`` (taken as written: a value in it may hold braces)."""
        return cls("{" + field + "} " + text.replace("{", "{{").replace("}", "}}"))

    def said(self, name: Callable[[str], str] = str) -> str:
        """The message, each field said as ``name(field)``."""
        fields = {f for _, f, _, _ in string.Formatter().parse(self.template) if f}
        return self.template.format(**{f: name(f) for f in fields})

    def __reduce__(self):   # Ray re-raises it in the caller
        return (type(self), (self.template,))


DEFAULT_RETRY_AFTER_S = 1.0   # a refusal with no estimate of when room comes back


class CapacityError(PdserveError):
    """No room now or within the request's SLO (maps to RESOURCE_EXHAUSTED). ``reason`` says
    which limit refused it, the ``reason`` label of the router's rejection count: ``ttft``
    (admission's prediction), ``queue_full`` (max_queued_requests), ``queue_deadline`` (queued
    past its TTFT), ``max_streams`` (max_concurrent_streams), else ``capacity``.
    ``retry_after_s``: when the same request would likely be taken (the client's hint: HTTP
    ``Retry-After``, gRPC's ``grpc-retry-pushback-ms``)."""

    def __init__(self, message: str, reason: str = "capacity", retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    def __reduce__(self):   # the reason survives pickling (Ray carries a worker's errors)
        return type(self), (str(self), self.reason, self.retry_after_s)


class KVTransferError(PdserveError):
    """KV blocks could not be moved or failed the layout check; the request is never decoded from them."""


class WorkerFailedError(PdserveError):
    """A worker died or raised mid-request (maps to UNAVAILABLE)."""


class PeerLostError(PdserveError):
    """The worker on the other side of a hand-off died: the request must move elsewhere."""


class UnsupportedModelError(PdserveError, ValueError):
    """The engine cannot serve this model (engine/model_support.py says why): raised when an
    engine is built, so a worker's start fails with the reason instead of failing every request."""
