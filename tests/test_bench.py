"""`pdserve bench`: dataset determinism, arrival statistics, metrics math on synthetic outcomes, the
OpenAI backend against a fake SSE server, and one real run against a launched tiny cluster."""

from __future__ import annotations

import asyncio
import json
import re
import math
import statistics
import threading
from pathlib import Path

import pytest
from aiohttp import web

from deploy.bench import report
from deploy.bench.backends import FAILED, OK, REJECTED, OpenAIBackend, RequestOutcome, parse_sse_line
from deploy.bench.cli import cluster_config, is_loopback, main, run_parser
from deploy.bench.dataset import BenchRequest, arrival_offsets, length_range, make_requests

# ---------------------------------------------------------------- dataset and arrivals


def test_same_seed_same_requests_other_seed_other_requests():
    a = make_requests("random", 50, 64, 16, range_ratio=0.5, seed=7)
    b = make_requests("random", 50, 64, 16, range_ratio=0.5, seed=7)
    c = make_requests("random", 50, 64, 16, range_ratio=0.5, seed=8)
    assert a == b and a != c
    assert all(32 <= r.prompt_len <= 96 and 8 <= r.output_len <= 24 for r in a)
    assert len({r.prompt_len for r in a}) > 5, "range ratio 0.5 should spread lengths"
    assert all(1000 <= t < 40000 for r in a for t in r.prompt_token_ids)
    # a prefix of a longer run is the shorter run: draws are per request, in order
    assert make_requests("random", 10, 64, 16, range_ratio=0.5, seed=7) == a[:10]


def test_fixed_dataset_exact_lengths_and_vocab():
    reqs = make_requests("fixed", 20, 33, 9, range_ratio=0.9, vocab=(3, 10), seed=1)
    assert {r.prompt_len for r in reqs} == {33} and {r.output_len for r in reqs} == {9}
    assert {t for r in reqs for t in r.prompt_token_ids} <= set(range(3, 10))


def test_length_range_bounds():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(1, 0.9) == (1, 1)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_poisson_arrivals_mean_gap_and_dispersion():
    n, rate = 20000, 4.0
    offsets = arrival_offsets(n, rate, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, rel=0.05)   # exponential: CV 1
    bursty = arrival_offsets(n, rate, burstiness=0.25, seed=3)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.fmean(bgaps) == pytest.approx(1 / rate, rel=0.05)   # same rate...
    assert statistics.stdev(bgaps) / statistics.fmean(bgaps) == pytest.approx(2.0, rel=0.1)  # ...burstier
    assert arrival_offsets(5, 2.0, seed=3) == arrival_offsets(5, 2.0, seed=3)
    doubled = arrival_offsets(100, 8.0, seed=3)   # same draws, rescaled: a sweep varies only the rate
    assert doubled == pytest.approx([t / 2 for t in offsets[:100]])
    assert arrival_offsets(4, math.inf) == [0.0] * 4


# ---------------------------------------------------------------- metrics math


def outcome(idx, status=OK, ttft=0.1, e2e=0.5, out=5, itls=None) -> RequestOutcome:
    return RequestOutcome(idx, status, prompt_len=10, expected_output_len=out, output_len=out if status == OK else 0,
                          ttft_s=ttft if status == OK else None, e2e_s=e2e,
                          itls=list(itls if itls is not None else [0.1] * (out - 1)) if status == OK else [])


def test_percentiles_match_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert report.percentile(xs, 50) == 3.0
    assert report.percentile(xs, 90) == pytest.approx(4.6)
    assert report.percentile(xs, 99) == pytest.approx(4.96)
    assert report.percentile([7.0], 99) == 7.0 and math.isnan(report.percentile([], 50))


def test_goodput_and_attainment_with_failures_and_rejections():
    outcomes = [
        outcome(0, ttft=0.1, e2e=0.5),            # tpot 0.1: good
        outcome(1, ttft=0.3, e2e=0.7),            # ttft misses
        outcome(2, ttft=0.1, e2e=1.3),            # tpot 0.3 misses
        outcome(3, ttft=0.1, e2e=0.1, out=1),     # one token: TPOT cannot be missed
        outcome(4, status=REJECTED),
        outcome(5, status=FAILED),
    ]
    s = report.summarize(outcomes, duration_s=2.0, slos_ms={"ttft": 200, "tpot": 150})
    assert (s["submitted"], s["completed"], s["failed"], s["rejected"], s["good"]) == (6, 4, 1, 1, 2)
    assert s["goodput"] == pytest.approx(1.0)              # 2 good / 2 s
    assert s["slo_attainment"] == pytest.approx(2 / 6)     # rejections and failures are misses
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["total_output_tokens"] == 16 and s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx((40 + 16) / 2)
    assert s["mean_ttft_ms"] == pytest.approx(150.0) and s["median_ttft_ms"] == pytest.approx(100.0)
    assert s["median_tpot_ms"] == pytest.approx(100.0)     # tpot over the three with >= 2 tokens
    assert s["p99_tpot_ms"] == pytest.approx(report.percentile([100, 100, 300], 99))
    assert s["mean_itl_ms"] == pytest.approx(100.0)
    assert report.summarize(outcomes, 2.0)["goodput"] is None   # no SLOs, no goodput
    table = report.format_table(s)
    assert "Serving Benchmark Result" in table and "Rejected requests:" in table
    assert "good/submitted" in table and "P99 TTFT (ms):" in table


def test_parse_goodput():
    assert report.parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["foo:1"], ["ttft:0"]):
        with pytest.raises(ValueError):
            report.parse_goodput(bad)


def test_result_json_round_trip_with_inf_rate(tmp_path):
    s = report.summarize([outcome(0)], 1.0, {"ttft": 200})
    runs = [report.run_record(math.inf, 1.0, s, [outcome(0)])]
    doc = report.result_document("x", {"request_rate": math.inf}, {}, runs)
    back = report.load_result(report.save_result(doc, tmp_path / "r.json"))
    assert back["runs"][0]["request_rate"] == math.inf
    assert back["runs"][0]["outcomes"][0]["itls"] == [0.1] * 4


def test_loopback_only_by_default():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.1.2.3")
    with pytest.raises(SystemExit):
        main(["--address", "10.1.2.3:50051"])


@pytest.mark.parametrize("args", [["--output-len", "-4"], ["--input-len", "0"], ["--range-ratio", "1.5"],
                                  ["--burstiness", "0"], ["--max-concurrency", "0"], ["--max-duration-s", "0"],
                                  ["--max-duration-s", "nan"], ["--request-timeout-s", "-1"]])
def test_bad_options_are_a_usage_error_naming_them(args, capsys):
    """Found by a probe: a negative --output-len ended in a traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(["--address", "127.0.0.1:1", *args])
    assert exit_.value.code == 2 and args[0] in capsys.readouterr().err


# ---------------------------------------------------------------- OpenAI backend vs a fake SSE server


class FakeOpenAIServer:
    """A fake OpenAI-compatible server (not a model): streams fixed SSE chunks with known gaps
    from a background thread; records every request body."""

    FIRST_S, GAP_S, NUM_CHUNKS, HANG_S = 0.15, 0.06, 4, 3.0

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.reject_next = 0      # answer the next N with 429 (admission's refusal)
        self.fail_next = 0        # answer the next N with 500 (a failure)
        self.hang_next = 0        # answer the next N only after HANG_S
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.reject_next:
            self.reject_next -= 1
            return web.json_response({"error": "overloaded"}, status=429)
        if self.fail_next:
            self.fail_next -= 1
            return web.json_response({"error": "boom"}, status=500)
        if self.hang_next:
            self.hang_next -= 1
            await asyncio.sleep(self.HANG_S)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path.endswith("chat/completions")
        if chat:   # chat servers open with a role-only chunk: no content, so no first token yet
            await resp.write(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n')
        await asyncio.sleep(self.FIRST_S)
        for i in range(self.NUM_CHUNKS):
            if i:
                await asyncio.sleep(self.GAP_S)
            choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f"t{i}"}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": 2 * self.NUM_CHUNKS, "total_tokens": 0}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def start(self) -> str:
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def fake_openai():
    server = FakeOpenAIServer()
    url = server.start()
    yield server, url
    server.stop()


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


async def _send_one(url: str, req: BenchRequest, **kwargs) -> RequestOutcome:
    backend = OpenAIBackend(url, **kwargs)
    info = await backend.start()
    try:
        assert info["model"] == "fake-model"
        return await backend.send(req)
    finally:
        await backend.close()


def test_openai_backend_times_ttft_and_itl(fake_openai):
    server, url = fake_openai
    req = BenchRequest(0, [1001, 1002, 1003], 8)
    out = asyncio.run(_send_one(url, req))
    assert out.status == OK, out.error
    assert server.bodies[-1]["prompt"] == [1001, 1002, 1003] and server.bodies[-1]["ignore_eos"] is True
    assert server.bodies[-1]["max_tokens"] == 8 and server.bodies[-1]["model"] == "fake-model"
    assert FakeOpenAIServer.FIRST_S * 0.9 <= out.ttft_s < FakeOpenAIServer.FIRST_S + 0.5
    assert len(out.itls) == FakeOpenAIServer.NUM_CHUNKS - 1
    assert all(FakeOpenAIServer.GAP_S * 0.8 <= g < FakeOpenAIServer.GAP_S + 0.3 for g in out.itls)
    assert out.output_len == 8 and out.prompt_len == 7            # from usage, not chunk count
    assert out.tpot_s == pytest.approx((out.e2e_s - out.ttft_s) / 7)


def test_openai_backend_chat_counts_chunks_without_usage(fake_openai):
    server, url = fake_openai
    req = BenchRequest(1, [5, 6], 4, prompt_text="w5 w6")
    out = asyncio.run(_send_one(url, req, endpoint="/v1/chat/completions", flavor="transformers"))
    body = server.bodies[-1]
    assert out.status == OK and out.output_len == 4 and out.ttft_s >= FakeOpenAIServer.FIRST_S * 0.9
    assert body["messages"] == [{"role": "user", "content": "w5 w6"}] and body["max_completion_tokens"] == 4
    assert "ignore_eos" not in body and "stream_options" not in body   # transformers serve refuses/ignores them
    assert json.loads(body["generation_config"])["eos_token_id"] == -1


def test_openai_backend_429_is_a_rejection(fake_openai):
    server, url = fake_openai
    server.reject_next = 1
    out = asyncio.run(_send_one(url, BenchRequest(2, [1000], 2)))
    assert out.status == REJECTED and "429" in out.error


def test_parse_sse_line():
    assert parse_sse_line(b"data: [DONE]\n") == "[DONE]"
    assert parse_sse_line(b": keep-alive\n") is None and parse_sse_line(b"\n") is None
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}


def test_cli_openai_run_saves_json(fake_openai, tmp_path, capsys):
    _, url = fake_openai
    path = tmp_path / "openai.json"
    rc = main(["--backend", "openai", "--base-url", url, "--num-prompts", "3", "--num-warmups", "0",
               "--input-len", "4", "--output-len", "8", "--goodput", "ttft:2000", "--save-result", str(path)])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    run = json.loads(path.read_text())["runs"][0]
    assert run["summary"]["completed"] == 3 and run["summary"]["slo_attainment"] == 1.0


def test_max_duration_cancels_what_is_still_running(fake_openai):
    from deploy.bench.runner import run_rate

    _, url = fake_openai
    reqs = make_requests("fixed", 3, 4, 8, seed=0)

    async def go():
        backend = OpenAIBackend(url)
        await backend.start()
        try:   # every first chunk comes after FIRST_S: nothing finishes inside the limit
            return await run_rate(backend, reqs, math.inf, max_duration_s=FakeOpenAIServer.FIRST_S / 3)
        finally:
            await backend.close()

    run = asyncio.run(go())
    assert [o.status for o in run.outcomes] == [FAILED] * 3 and run.num_not_sent == 0
    assert all("max-duration" in o.error for o in run.outcomes)
    assert run.duration_s < FakeOpenAIServer.FIRST_S


# ---------------------------------------------------------------- end to end: a launched tiny cluster


def test_launch_options_build_the_small_cluster_config():
    args = run_parser().parse_args(["--launch", "disaggregated", "--random-model", "--num-kv-blocks", "128",
                                    "--cpus-per-worker", "0.5", "--threads-per-worker", "1"])
    cfg = cluster_config(args)
    assert (cfg.mode, cfg.random_model, cfg.port, cfg.cpus_per_worker, cfg.threads_per_worker) == \
        ("disaggregated", {"seed": 0}, 0, 0.5, 1)
    assert cfg.prefill_engine.num_kv_blocks == 128 and cfg.decode_engine.num_kv_blocks == 128


def test_launch_prefill_count_is_serves_rule(capsys, monkeypatch):
    """Found by a probe: `--launch colocated --num-prefill 2` ignored the count (serve refuses it)."""
    import ray

    assert (cluster_config(run_parser().parse_args(["--launch", "colocated", "--random-model"])).num_prefill,
            cluster_config(run_parser().parse_args(["--launch", "disaggregated", "--random-model"])).num_prefill,
            cluster_config(run_parser().parse_args(["--launch", "disaggregated", "--num-prefill", "3"])).num_prefill
            ) == (0, 1, 3)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("no cluster for a count that cannot take effect"))
    with pytest.raises(SystemExit) as exit_:
        main(["--launch", "colocated", "--random-model", "--num-prefill", "2"])
    assert exit_.value.code == 2
    assert "--num-prefill 2: colocated mode has no prefill workers" in capsys.readouterr().err


def test_launched_cluster_end_to_end(ray_session, tmp_path, capsys):
    result = tmp_path / "disagg.json"
    plots = tmp_path / "plots"
    rc = main(["--launch", "disaggregated", "--random-model", "--num-kv-blocks", "128",
               "--cpus-per-worker", "0.5", "--threads-per-worker", "1",
               "--num-prompts", "12", "--request-rate", "20", "--input-len", "32", "--output-len", "8",
               "--num-warmups", "1", "--goodput", "ttft:10000", "tpot:5000", "--max-duration-s", "60",
               "--label", "pdserve-tiny", "--save-result", str(result), "--plot-dir", str(plots)])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    doc = json.loads(result.read_text())
    run = doc["runs"][0]
    s = run["summary"]
    assert (s["completed"], s["failed"], s["rejected"]) == (12, 0, 0)
    assert all(o["output_len"] == 8 and o["prompt_len"] == 32 for o in run["outcomes"])
    assert all(o["ttft_s"] > 0 and len(o["itls"]) == 7 for o in run["outcomes"])
    assert s["total_output_tokens"] == 96 and doc["server"]["mode"] == "disaggregated"
    for name in ("attainment_vs_rate.png", "goodput_vs_rate.png", "ttft_cdf.png", "tpot_cdf.png"):
        assert (plots / name).stat().st_size > 1000
    # two systems side by side: a second labelled file merged by the plot subcommand
    other = json.loads(result.read_text())
    other["label"] = "baseline"
    (tmp_path / "other.json").write_text(json.dumps(other))
    merged = tmp_path / "merged"
    assert main(["plot", str(result), str(tmp_path / "other.json"), "--out", str(merged)]) == 0
    assert len(list(Path(merged).glob("*.png"))) == 4


def test_a_launched_worker_that_cannot_be_built_is_named_not_a_traceback(ray_session, capsys):
    """A pool far past the machine's memory: the worker's constructor fails, the run ends with one
    line naming the worker and why."""
    rc = main(["--launch", "disaggregated", "--random-model", "--num-kv-blocks", "100000000000",
               "--cpus-per-worker", "0.5", "--threads-per-worker", "1", "--num-prompts", "2"])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"pdserve bench: error: (prefill|decode)-0 could not start: .*allocate.*", err[-1]), err


def test_a_server_that_is_not_there_is_named_not_a_traceback(capsys):
    """Found by a probe: the gRPC error of the first call (ServerInfo) ended in a traceback."""
    assert main(["--address", "127.0.0.1:1", "--num-prompts", "2"]) == 1
    assert "pdserve bench: error: 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err


def test_an_openai_server_that_is_not_there_is_named_not_a_table_of_nan(capsys):
    """Found by a probe: the OpenAI backend ran every request against nothing and printed a table
    of ``nan``; now it says so before any run, as the gRPC backend does."""
    assert main(["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2",
                 "--num-warmups", "0"]) == 1
    captured = capsys.readouterr()
    assert "pdserve bench: error: http://127.0.0.1:1: " in captured.err, captured.err
    assert "nan" not in captured.out and "Serving Benchmark Result" not in captured.out


def test_a_base_url_ending_in_v1_is_the_same_server(fake_openai):
    """OpenAI clients' base_url ends in /v1; the endpoints carry it already (found by a probe: every
    request got a 404 from /v1/v1/completions)."""
    _, url = fake_openai
    out = asyncio.run(_send_one(url + "/v1/", BenchRequest(0, [1001, 1002], 4)))
    assert out.status == OK, out.error


@pytest.mark.parametrize("remote", [[], ["--allow-remote"]])
@pytest.mark.parametrize("target", ["not a url at all", "127.0.0.1:8000", "ftp://127.0.0.1/", "http://127.0.0.1:99999",
                                    "http://[::1", " http://127.0.0.1:8000"])
def test_a_base_url_that_is_no_http_url_is_a_usage_error_naming_it(target, remote, capsys):
    """Found by a probe: ``--base-url not-a-url`` was refused as "'' is not a loopback address"."""
    with pytest.raises(SystemExit) as exit_:
        main(["--backend", "openai", "--base-url", target, *remote, "--num-prompts", "2"])
    assert exit_.value.code == 2
    assert f"--base-url must be an http(s) URL such as http://127.0.0.1:8000, got {target!r} (" in capsys.readouterr().err


@pytest.fixture
def silent_socket():
    """A port that takes connections (the kernel's backlog) and never says a word."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_a_server_that_takes_the_connection_and_never_answers_is_named_not_waited_on(
        backend, silent_socket, monkeypatch, capsys):
    """Found by a probe: against such a socket the run waited forever (no request timeout by default)."""
    import time

    from deploy.bench import backends

    monkeypatch.setattr(backends, "INFO_TIMEOUT_S", 1.0)
    target = (["--address", f"127.0.0.1:{silent_socket}"] if backend == "grpc" else
              ["--backend", "openai", "--base-url", f"http://127.0.0.1:{silent_socket}"])
    start = time.monotonic()
    assert main([*target, "--num-prompts", "2"]) == 1
    assert time.monotonic() - start < 15
    err = capsys.readouterr().err
    assert f"127.0.0.1:{silent_socket}: no answer to " in err and "within 1 s" in err, err


def test_warm_up_that_outlasts_max_duration_is_cut_and_named(fake_openai, capsys):
    """A server that answers what it serves but not the requests: the warm-up is bounded by
    ``--max-duration-s`` as each run is (it had no bound), and says so."""
    server, url = fake_openai
    server.hang_next = 2
    rc = main(["--backend", "openai", "--base-url", url, "--num-prompts", "2", "--num-warmups", "2",
               "--max-duration-s", "0.5"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "pdserve bench: error: every warm-up request failed, the first with: cancelled at --max-duration-s" \
        in captured.err, captured.err
    assert "Serving Benchmark Result" not in captured.out


@pytest.mark.parametrize(("fail", "reject", "rc", "said"), [
    (0, 1, 0, None),
    (1, 1, 1, "pdserve bench: error: 1 of 3 requests failed, the first with: HTTP 500: "),
    (0, 3, 1, "pdserve bench: error: none of 3 requests was served (3 refused by admission)"),
])
def test_exit_status_says_whether_every_request_was_answered(fake_openai, capsys, fail, reject, rc, said):
    """Refusals under overload are answers; a failed request (found by a probe: exit 0 with some
    failed) or a run where nothing was served ends with 1 and a line saying so."""
    server, url = fake_openai
    server.fail_next, server.reject_next = fail, reject
    assert main(["--backend", "openai", "--base-url", url, "--num-prompts", "3", "--num-warmups", "0",
                 "--input-len", "4", "--output-len", "8"]) == rc
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    errors = [line for line in captured.err.splitlines() if "pdserve bench: error" in line]
    assert errors == ([] if said is None else [errors[0]]) and (said is None or errors[0].startswith(said)), errors


def test_a_server_that_is_not_openai_is_one_line_not_a_table(capsys):
    """An HTTP server that answers every request with an error (here: 501 to every POST): the
    warm-up finds out, and nothing runs."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc = main(["--backend", "openai", "--base-url", f"http://127.0.0.1:{server.server_port}",
                   "--num-prompts", "2", "--num-warmups", "1"])
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert rc == 1
    assert "pdserve bench: error: every warm-up request failed" in captured.err, captured.err
    assert "Serving Benchmark Result" not in captured.out and "<html" not in captured.err.lower()


def test_ctrl_c_mid_run_ends_with_the_shells_status_not_a_traceback(monkeypatch, capsys):
    """Found by a probe: Ctrl-C during ``pdserve bench`` printed a 40-line KeyboardInterrupt."""
    import deploy.bench.cli as bench_cli
    from deploy.cli import main as pdserve_main

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli, "main", interrupted)
    assert pdserve_main(["bench", "--num-prompts", "2"]) == 130
    assert capsys.readouterr().err == "pdserve bench: interrupted\n"
