"""OpenTelemetry traces across the router and both workers, over a real cluster (tiny random
Llama, real Ray actors). The router and each worker export their own spans; here every process
appends them to one JSON-lines file (``TracingConfig.jsonl_path``), which the test reads: one
trace per request, with the router's ``request`` span as the root, the prefill worker's
``prefill`` (queue, compute, KV hand-off with bytes and transport) and the decode worker's
``decode`` parented on it across the Ray calls. The same spans also go out over OTLP/HTTP
(``--otlp-traces-endpoint``: the batched exporter every process runs in a deployment) to a
local sink that decodes them: each request's trace arrives from all three processes. Without a
tracing config nothing is traced. A client's own W3C trace context (HTTP header, gRPC
metadata) is continued; the request span names the client's request id and the token counts,
and a request failed by the server's fault is an error span; an OpenAI body's choices are one
trace. A collector that accepts connections and never answers holds
``reset()`` (each stop) for ``FLUSH_AT_STOP_S``, not the exporter's timeouts and retries.
"""

from __future__ import annotations

import json
import socket
import time
from collections import defaultdict

import grpc
import openai
import pytest
import ray

from benchmarks.otlp_sink import OtlpSink
from engine import tracing
from protos import pdserve_pb2_grpc as pb_grpc
from router.client import PdserveClient, build_request
from tests.conftest import cluster_leaks
from tests.test_cluster_e2e import address, start_cluster


def test_untraced_by_default_costs_nothing():
    assert tracing.tracer() is tracing._NOOP and not tracing.enabled()
    assert tracing.start("request", door="grpc") is None
    assert tracing.child(None, "tokenize") is tracing._NULL and tracing.current_child("kv_handoff") is tracing._NULL
    span = tracing.tracer().start_span("request")
    assert not span.is_recording() and tracing.traceparent_of(span) is None and tracing.context_of(None) is None
    spans = tracing.RequestSpans()
    spans.remember("r", None)
    spans.open("r", "decode")
    assert not spans
    assert tracing.otlp_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.otlp_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_a_collector_that_never_answers_holds_the_stop_only_briefly(caplog):
    silent = socket.create_server(("127.0.0.1", 0))   # accepts (the kernel's backlog), never answers
    try:
        tracing.configure(tracing.TracingConfig(otlp_endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}"), "test")
        tracing.tracer().start_span("request").end()   # batched for export
        started = time.monotonic()
        tracing.reset(flush_s=1.0)
        waited = time.monotonic() - started
    finally:
        silent.close()
    assert 0.9 < waited < 3.0, f"reset waited {waited:.1f} s"
    assert "the OTLP collector does not answer" in caplog.text
    assert tracing.tracer() is tracing._NOOP and not tracing.enabled()


@pytest.fixture(scope="module")
def sink():
    sink = OtlpSink()
    yield sink
    sink.close()


@pytest.fixture(scope="module")
def traced(ray_session, tmp_path_factory, sink):
    path = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    config = tracing.TracingConfig(jsonl_path=str(path), otlp_endpoint=sink.url)
    cluster = start_cluster("disaggregated", http_port=0, tracing=config)
    yield cluster, path
    cluster.stop()
    assert tracing.tracer() is tracing._NOOP and not tracing.enabled(), "stop() turns tracing off"


def _spans(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _traces(path, num_requests: int, timeout_s: float = 20.0) -> dict[str, list[dict]]:
    """Spans by trace id, once ``num_requests`` traces hold a decode span (it ends with the last
    token, exported from the decode worker's process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        by_trace = defaultdict(list)
        for span in _spans(path):
            by_trace[span["trace_id"]].append(span)
        done = [t for t, spans in by_trace.items() if {"decode", "request"} <= {s["name"] for s in spans}]
        if len(done) >= num_requests or time.monotonic() > deadline:
            return dict(by_trace)
        time.sleep(0.1)


def test_one_trace_per_request_across_router_prefill_and_decode(traced, sink):
    cluster, path = traced
    with PdserveClient(address(cluster)) as client:
        client.generate_text(token_ids=list(range(3, 60)), max_tokens=6, ignore_eos=True)
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.cluster.http_port}/v1", api_key="x", max_retries=0)
    http.completions.create(model=http.models.list().data[0].id, prompt=list(range(5, 40)), max_tokens=4,
                            extra_body={"ignore_eos": True})
    traces = _traces(path, 2)
    assert len(traces) == 2, f"one trace per request, got {len(traces)}"
    doors = set()
    for spans in traces.values():
        by_name = {s["name"]: s for s in spans}
        assert sorted(by_name) == sorted(["request", "tokenize", "admission", "stream", "prefill", "prefill.queue",
                                          "prefill.compute", "kv_handoff", "decode"]), sorted(by_name)
        root = by_name["request"]
        assert root["parent_id"] is None and root["service"] == "pdserve-router"
        doors.add(root["attributes"]["pdserve.door"])
        for name in ("tokenize", "admission", "stream", "prefill", "decode"):
            assert by_name[name]["parent_id"] == root["span_id"], name
        for name in ("prefill.queue", "prefill.compute", "kv_handoff"):
            assert by_name[name]["parent_id"] == by_name["prefill"]["span_id"], name
        assert by_name["prefill"]["service"] == "pdserve-prefill-worker"
        assert by_name["decode"]["service"] == "pdserve-decode-worker"
        handoff = by_name["kv_handoff"]["attributes"]
        assert handoff["pdserve.kv.bytes"] > 0 and handoff["pdserve.kv.transport"] and handoff["pdserve.kv.outcome"] == "ok"
        assert by_name["decode"]["attributes"]["pdserve.finish_reason"] == "length"
        assert root["attributes"]["pdserve.outcome"] == "length"
        assert root["start_ns"] <= by_name["prefill"]["start_ns"] <= by_name["decode"]["start_ns"] <= root["end_ns"]
    assert doors == {"grpc", "http"}
    assert cluster_leaks(cluster) == {}
    services = {"pdserve-router", "pdserve-prefill-worker", "pdserve-decode-worker"}
    deadline = time.monotonic() + 20   # the batch processors send every 5 s
    while time.monotonic() < deadline and not all(sink.traces().get(t) == services for t in traces):
        time.sleep(0.2)
    assert {t: sink.traces().get(t) for t in traces} == {t: services for t in traces}, "OTLP export"


def test_an_aborted_request_ends_its_decode_span(traced):
    cluster, path = traced
    before = len(_traces(path, 0, timeout_s=0))
    with PdserveClient(address(cluster)) as client:
        stream = client.generate(token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True)
        next(stream), next(stream)
        stream.close()
    assert cluster_leaks(cluster) == {}
    traces = _traces(path, before + 1)
    aborted = [s for spans in traces.values() for s in spans if s["name"] == "decode"
               and s["attributes"].get("pdserve.aborted")]
    assert aborted, "the cancelled request's decode span was not ended"


CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


def _client_traceparent(span_id: str) -> str:
    return f"00-{CLIENT_TRACE}-{span_id}-01"


def _trace_of(path, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in _spans(path) if s["trace_id"] == trace_id]
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_a_clients_trace_context_is_continued_on_both_doors(traced):
    """Found by a probe: a client's ``traceparent`` was ignored, every request a new root."""
    cluster, path = traced
    before = {s["span_id"] for s in _spans(path)}
    grpc_parent, http_parent = "00f067aa0ba902b7", "b7ad6b7169203331"
    with grpc.insecure_channel(address(cluster)) as channel:
        stub = pb_grpc.PdserveStub(channel)
        list(stub.Generate(build_request(None, None, [5, 6, 7], max_tokens=3, ignore_eos=True, request_id="mine-1"),
                           metadata=(("traceparent", _client_traceparent(grpc_parent)), ("tracestate", "k=v")),
                           timeout=60))
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.cluster.http_port}/v1", api_key="x", max_retries=0)
    http.completions.create(model=http.models.list().data[0].id, prompt=[5, 6, 7, 8], max_tokens=2,
                            extra_body={"ignore_eos": True},
                            extra_headers={"traceparent": _client_traceparent(http_parent), "X-Request-Id": "mine-2"})
    spans = [s for s in _trace_of(path, CLIENT_TRACE, {"request", "decode"}) if s["span_id"] not in before]
    roots = {s["attributes"]["pdserve.door"]: s for s in spans if s["name"] == "request"}
    assert set(roots) == {"grpc", "http"}, spans
    assert roots["grpc"]["parent_id"] == grpc_parent and roots["http"]["parent_id"] == http_parent
    assert roots["grpc"]["attributes"]["pdserve.label"] == "mine-1" and roots["http"]["attributes"]["pdserve.label"] == "mine-2"
    assert (roots["grpc"]["attributes"]["pdserve.prompt_tokens"], roots["grpc"]["attributes"]["pdserve.completion_tokens"]) == (3, 3)
    assert (roots["http"]["attributes"]["pdserve.prompt_tokens"], roots["http"]["attributes"]["pdserve.completion_tokens"]) == (4, 2)
    assert all(s["status"] == "UNSET" for s in roots.values())
    # the workers' spans join the same trace, under the router's request span
    decode = [s for s in spans if s["name"] == "decode"]
    assert {s["parent_id"] for s in decode} <= {r["span_id"] for r in roots.values()} and decode
    # a context that does not parse starts a root, as OpenTelemetry's propagator does
    with grpc.insecure_channel(address(cluster)) as channel:
        list(pb_grpc.PdserveStub(channel).Generate(build_request(None, None, [5, 6], max_tokens=1, request_id="mine-3"),
                                                   metadata=(("traceparent", "garbage"),), timeout=60))
    deadline = time.monotonic() + 20
    while not (mine := [s for s in _spans(path) if s["name"] == "request" and s["attributes"].get("pdserve.label") == "mine-3"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert mine[0]["parent_id"] is None
    assert cluster_leaks(cluster) == {}


def test_an_http_bodys_choices_are_one_trace(traced):
    cluster, path = traced
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.cluster.http_port}/v1", api_key="x", max_retries=0)
    out = http.completions.create(model=http.models.list().data[0].id, prompt=[[5, 6], [7, 8]], max_tokens=2, n=2,
                                  extra_body={"ignore_eos": True})
    label = out.id.removeprefix("cmpl-")   # the response's id names the request the trace is found by
    deadline = time.monotonic() + 20
    while not (top := [s for s in _spans(path) if s["name"] == "choices" and s["attributes"].get("pdserve.label") == label]):
        assert time.monotonic() < deadline, "no choices span"
        time.sleep(0.1)
    (choices,) = top
    spans = _trace_of(path, choices["trace_id"], {"choices"})
    deadline = time.monotonic() + 20
    while len([s for s in spans if s["name"] == "decode"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
        spans = _trace_of(path, choices["trace_id"], {"choices"})
    requests = [s for s in spans if s["name"] == "request"]
    assert len(requests) == 4 and {s["parent_id"] for s in requests} == {choices["span_id"]}
    assert choices["parent_id"] is None and choices["attributes"]["pdserve.num_choices"] == 4
    assert len([s for s in spans if s["name"] == "decode"]) == 4
    assert cluster_leaks(cluster) == {}


def test_a_request_failed_by_the_server_is_an_error_span_and_a_refused_one_is_not(traced):
    cluster, path = traced
    decode = cluster.cluster.registry.get("decode-0")
    with PdserveClient(address(cluster)) as client:
        stream = client.generate(token_ids=list(range(10, 30)), max_tokens=300, ignore_eos=True, request_id="fails-1")
        next(stream)
        ray.get(decode.actor.inject_fault.remote("step"))
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text(token_ids=[10**6], max_tokens=2, request_id="invalid-1")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 20
    while len(roots := {s["attributes"].get("pdserve.label"): s for s in _spans(path) if s["name"] == "request"
                        and s["attributes"].get("pdserve.label") in ("fails-1", "invalid-1")}) < 2:
        assert time.monotonic() < deadline, roots
        time.sleep(0.1)
    assert roots["fails-1"]["status"] == "ERROR" and "exception" in roots["fails-1"]["events"]
    assert roots["fails-1"]["attributes"]["pdserve.outcome"] == "RequestFailedError"
    assert roots["invalid-1"]["status"] == "UNSET" and roots["invalid-1"]["attributes"]["pdserve.outcome"] == "InvalidRequestError"
    assert cluster_leaks(cluster) == {}
