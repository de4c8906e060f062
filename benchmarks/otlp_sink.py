"""A local OTLP/HTTP trace receiver that counts spans and discards them: what a collector does
for the processes that export to it, without running one (the tracing benchmark and test point
``--otlp-traces-endpoint`` here).

Life cycle: ``OtlpSink()`` binds a loopback port and serves ``POST /v1/traces`` on a daemon
thread (``url`` is the endpoint to give pdserve); each request body (protobuf
``ExportTraceServiceRequest``, gzip or not) is decoded, its spans counted per service name and
span name, and answered with an empty ``ExportTraceServiceResponse``; ``close()`` stops it.
``OtlpSinkProcess`` runs one in a child process, for benchmarks (a collector is not the
measured process).
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import multiprocessing
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_RESPONSE = ExportTraceServiceResponse().SerializeToString()


class OtlpSink:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()   # (service, span name)
        self._traces: dict[str, set[str]] = collections.defaultdict(set)   # trace id -> services seen
        self.requests = 0
        self._server = ThreadingHTTPServer((host, 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self._lock:
            self.requests += 1
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self._counts[(service, span.name)] += 1
                        self._traces[span.trace_id.hex()].add(service)

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def traces(self) -> dict[str, set[str]]:
        """Trace id -> the services that sent spans of it."""
        with self._lock:
            return {t: set(s) for t, s in self._traces.items()}

    @property
    def num_spans(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(sink: OtlpSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, as the exporter's session expects

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path.rstrip("/") != "/v1/traces":
                self.send_error(404)
                return
            sink.receive(body)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(_RESPONSE)))
            self.end_headers()
            self.wfile.write(_RESPONSE)

        def log_message(self, format: str, *args) -> None:   # quiet: one line per batch otherwise
            pass

    return Handler


class OtlpSinkProcess:
    """An ``OtlpSink`` in a process of its own, with the same read-outs: a collector runs
    outside the measured processes, and a sink thread in the benchmark's own process would take
    its GIL (decoding every batch) from the gRPC client that timestamps the tokens, charging the
    sink's work to the traced server's TPOT.

    Life cycle: ``OtlpSinkProcess()`` spawns the child and waits for its URL; the read-outs ask
    the child over a pipe; ``close()`` stops it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_sink, args=(child,), name="otlp-sink", daemon=True)
        self._proc.start()
        self.url: str = self._conn.recv()

    def _ask(self, what: str):
        self._conn.send(what)
        return self._conn.recv()

    def counts(self) -> dict[tuple[str, str], int]:
        return self._ask("counts")

    def traces(self) -> dict[str, set[str]]:
        return self._ask("traces")

    @property
    def num_spans(self) -> int:
        return self._ask("num_spans")

    @property
    def requests(self) -> int:
        return self._ask("requests")

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._ask("close")
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def _serve_sink(conn) -> None:
    """The child: one sink, answering read-outs until told to close."""
    sink = OtlpSink()
    conn.send(sink.url)
    while True:
        what = conn.recv()
        if what == "close":
            sink.close()
            conn.send(None)
            return
        value = getattr(sink, what)
        conn.send(value() if callable(value) else value)
