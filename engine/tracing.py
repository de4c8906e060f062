"""OpenTelemetry tracing shared by the router and both workers (torch-free).

One trace per request: the router's ``request`` span is the root (``tokenize``, ``admission``
and ``stream`` under it), or the child of the client's own span when the client sent a W3C
trace context (``traceparent`` / ``tracestate`` header or gRPC metadata: ``client_context``);
it names the client's request id (``label``), the token counts, and, when the request failed
by the server's fault, the error (status ERROR). The choices of one OpenAI body (n > 1, a
batch of prompts) are each a ``request`` under one ``choices`` span; its W3C ``traceparent`` rides in ``RequestSpec.traceparent`` over the
Ray calls, and each worker parents its own spans on it: the prefill worker's ``prefill``
(``prefill.queue``, ``prefill.compute``, ``kv_handoff`` with bytes, transport and outcome) and
the decode worker's ``decode`` (KV commit to the request's last token). Each process exports its
own spans.

Life cycle: ``configure(config, service)`` once per process (the router in ``Cluster.start``,
each worker in its constructor); without an endpoint nothing is configured, ``enabled()`` is
False and no span object is ever made: the router starts no span (``start``, ``child`` give
None and a shared null context), specs carry no traceparent, and the workers, which trace a
request only under its traceparent (``context_of``, ``current_child``), do nothing per request.
``reset()`` flushes (for up to ``FLUSH_AT_STOP_S``: a collector that does not answer costs the stop
that long, not the exporter's timeouts and retries) and goes back to off (``Cluster.stop``, a
worker's shutdown).

Exporters: OTLP over HTTP (``--otlp-traces-endpoint``, vLLM's flag name) behind a
``BatchSpanProcessor`` in every process: ending a span only queues it, a background thread
encodes and sends batches, so the request path never waits on the export. A JSON-lines file
(``jsonl_path``: tests, and a look without a collector) is written synchronously, one line per
span with one ``write`` so several processes can share the file: for tests, not for production.
Spans are per request and per phase, never per token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.errors import ConfigError

logger = logging.getLogger(__name__)

FLUSH_AT_STOP_S = 3.0   # for spans still batched to reach the collector when tracing is reset
_PROPAGATOR = TraceContextTextMapPropagator()
_W3C_FIELDS = frozenset(_PROPAGATOR.fields)   # traceparent, tracestate: a client's header / metadata keys
_NOOP = trace.NoOpTracer()


@dataclass(frozen=True, slots=True)
class TracingConfig:
    otlp_endpoint: str | None = None   # e.g. http://collector:4318 (OTLP/HTTP; /v1/traces is added)
    jsonl_path: str | None = None      # append finished spans as JSON lines here

    def __post_init__(self) -> None:
        """OTLPSpanExporter posts to the endpoint with ``requests``: anything but an http(s) URL with
        a host would fail each export in a background thread, in silence, after the cluster started."""
        if self.otlp_endpoint is not None and not _http_url(self.otlp_endpoint):
            raise ConfigError.on("otlp_endpoint", "must be an http(s) URL with a host, such as "
                                                  f"http://127.0.0.1:4318, got {self.otlp_endpoint!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.jsonl_path)


_state: dict = {"tracer": _NOOP, "provider": None}


_NULL = contextlib.nullcontext()   # reusable: what ``child`` / ``current_child`` give when off


def tracer() -> trace.Tracer:
    return _state["tracer"]


def enabled() -> bool:
    return _state["provider"] is not None


def client_context(pairs: Iterable[tuple[str, object]]) -> dict[str, str] | None:
    """The W3C trace context a client sent with its request (HTTP headers, gRPC metadata), for
    ``start``'s ``parent``; None when tracing is off or it sent none."""
    if not enabled():
        return None
    carrier = {key.lower(): value for key, value in pairs if key.lower() in _W3C_FIELDS and isinstance(value, str)}
    return carrier or None


def start(name: str, parent: Mapping[str, str] | None = None, **attributes) -> trace.Span | None:
    """A request's span (the router's ``request``): under ``parent``, a W3C trace context (the
    client's, or the router's own span for the choices of one body), else a root; None when
    tracing is off. A context that does not parse starts a root, as OpenTelemetry's propagator
    does."""
    if not enabled():
        return None
    context = _PROPAGATOR.extract(parent) if parent else None
    return tracer().start_span(name, context=context, kind=trace.SpanKind.SERVER, attributes=_attrs(attributes))


def end(span: trace.Span, error: BaseException | None = None, **attributes) -> None:
    """End ``span`` with ``attributes``; ``error``: the server's fault it ended with (status ERROR,
    the exception recorded), so trace back ends count it as failed."""
    span.set_attributes(_attrs(attributes))
    if error is not None:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.end()


def context_of_span(span: trace.Span | None) -> dict[str, str] | None:
    """``span`` as a trace context for ``start``'s ``parent``; None without a span."""
    traceparent = traceparent_of(span) if span is not None else None
    return {"traceparent": traceparent} if traceparent else None


def child(parent: trace.Span | None, name: str):
    """A span under ``parent`` (a context manager that ends it); with no parent, a null context."""
    if parent is None:
        return _NULL
    return tracer().start_span(name, context=trace.set_span_in_context(parent))


def current_child(name: str):
    """A context manager: a span under the current one when it records (a worker's traced
    request), yielded; else nothing (yields None)."""
    if not trace.get_current_span().is_recording():
        return _NULL
    return tracer().start_as_current_span(name)


def _attrs(attributes: dict) -> dict:
    return {f"pdserve.{k}": v for k, v in attributes.items()}


def configure(config: TracingConfig | None, service: str) -> None:
    if config is None or not config.enabled:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    reset()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if config.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url(config.otlp_endpoint))))
    if config.jsonl_path:
        provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(config.jsonl_path)))
    _state.update(tracer=provider.get_tracer("pdserve"), provider=provider)


def reset(flush_s: float = FLUSH_AT_STOP_S) -> None:
    """Back to off, flushing the spans still batched for up to ``flush_s``. The provider's own
    shutdown waits out the exporter's timeout and retries on a collector that accepts and never
    answers (~15 s measured), so it runs in a daemon thread that is waited for this long; what
    it has not sent by then is dropped with the process."""
    provider = _state["provider"]
    _state.update(tracer=_NOOP, provider=None)
    if provider is None:
        return
    flush = threading.Thread(target=provider.shutdown, name="pdserve-trace-flush", daemon=True)
    flush.start()
    flush.join(flush_s)
    if flush.is_alive():
        logger.warning("tracing: spans not exported within %.0f s (the OTLP collector does not answer); "
                       "dropping them", flush_s)


def _http_url(text: str) -> bool:
    try:
        url = urlparse(text)
        url.port   # noqa: B018 - raises for a port that is not a number in 0-65535
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname) and text == text.strip()


def otlp_url(endpoint: str) -> str:
    """OTLP/HTTP's traces URL: an endpoint given without a path gets ``/v1/traces``."""
    return endpoint if urlparse(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C traceparent naming ``span`` as parent; None for a no-op span."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def context_of(traceparent: str | None) -> Context | None:
    """The parent context a worker's span starts under; None when the request is not traced."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None


class JsonlSpanExporter:
    """A SpanExporter writing one JSON line per finished span (name, ids, parent, service, times,
    attributes)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def export(self, spans) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            os.write(self._fd, (json.dumps(_as_dict(span)) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        os.close(self._fd)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _as_dict(span) -> dict:
    ctx, parent = span.get_span_context(), span.parent
    return {"name": span.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
            "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
            "service": span.resource.attributes.get("service.name"), "start_ns": span.start_time,
            "end_ns": span.end_time, "attributes": dict(span.attributes or {}),
            "status": span.status.status_code.name, "events": [event.name for event in span.events]}


class RequestSpans:
    """A worker's spans that outlive one call: opened when a request starts there, ended with its
    last token or its abort (the decode worker's ``decode`` span). Holds entries for traced
    requests only; an untraced worker's is always empty."""

    def __init__(self) -> None:
        self._parents: dict[str, str] = {}        # req_id -> traceparent, until its span opens
        self._open: dict[str, trace.Span] = {}

    def __bool__(self) -> bool:
        return bool(self._parents or self._open)

    def remember(self, req_id: str, traceparent: str | None) -> None:
        if traceparent:
            self._parents[req_id] = traceparent

    def open(self, req_id: str, name: str, traceparent: str | None = None, **attributes) -> None:
        parent = context_of(traceparent or self._parents.pop(req_id, None))
        if parent is not None and req_id not in self._open:
            self._open[req_id] = tracer().start_span(name, context=parent, kind=trace.SpanKind.SERVER,
                                                     attributes=_attrs(attributes))

    def close(self, req_id: str, **attributes) -> None:
        self._parents.pop(req_id, None)
        span = self._open.pop(req_id, None)
        if span is not None:
            span.set_attributes(_attrs(attributes))
            span.end()
