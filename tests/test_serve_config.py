"""`pdserve serve` with a value no cluster could serve with: refused at once as a usage error
(exit status 2, the flag named, nothing started), before Ray or any worker. The same rules hold
for programmatic configs (ClusterConfig, EngineConfig, ServerLimits, TracingConfig raise a
ValueError, ConfigError, naming the field). And the
sampling flags of `pdserve generate` and `chat` reach the request."""

from __future__ import annotations

import pytest

from deploy.cli import main
from deploy.launcher import ClusterConfig
from engine.config import EngineConfig

REFUSED = [
    # each named by the flag the user typed (the config's field name in-process: ConfigError)
    ("--num-decode 0", "--num-decode must be >= 1"),
    ("--num-prefill 0", "--num-prefill must be >= 1 in disaggregated mode"),
    ("--mode colocated --num-prefill 3", "--num-prefill 3: colocated mode has no prefill workers"),   # a probe: ignored
    ("--mode colocated --num-prefill -1", "--num-prefill -1: colocated mode has no prefill workers"),
    ("--dtype float64", "--dtype must be auto or one of float32, float16, bfloat16"),
    ("--device tpu", "--device must be cpu, cuda, cuda:N or auto"),
    ("--port 70000", "--port must be in [0, 65535]"),
    ("--mode colocated --kv-transport shm", "--kv-transport applies to disaggregated mode only"),
    ("--random-model --model /tmp/m.gguf", "--model and --random-model are two models: give one"),
    ("--max-num-batched-tokens 0", "--block-size, --max-num-batched-tokens and --max-num-seqs must be >= 1"),
    ("--metrics-port -1", "--metrics-port must be in [0, 65535]"),
    ("--kv-cache-gib 0", "--kv-cache-gib must be a finite number > 0, got 0.0"),
    ("--kv-cache-gib inf", "--kv-cache-gib must be a finite number > 0, got inf"),     # a probe: a traceback
    ("--kv-cache-gib nan", "--kv-cache-gib must be a finite number > 0, got nan"),
    ("--max-receive-message-bytes 99999999999", "--max-receive-message-bytes must be at most 2^30"),   # after the start, before
    ("--max-concurrent-streams 99999999999", "--max-concurrent-streams must be at most 2^30"),
    ("--max-ttft-ms nan", "--max-ttft-ms must be > 0, got nan"),   # a probe: accepted
    ("--max-tpot-ms inf", "--max-tpot-ms must be a finite number, got inf"),
    ("--min-ttft-ms 5000 --max-ttft-ms 100", "--min-ttft-ms 5000.0 is above --max-ttft-ms 100.0"),   # was "SLO hint ranges"
    ("--scheduling-policy priority --min-priority 5 --max-priority 3", "--min-priority 5 is above --max-priority 3"),   # was "priority range"
    ("--threads-per-worker 0", "--threads-per-worker must be >= 1"),
    ("--cpus-per-worker 0", "--cpus-per-worker must be > 0"),
    ("--gpus-per-worker -1", "--gpus-per-worker must be > 0"),
    ("--ttft-ms -5", "--ttft-ms must be a finite number > 0, got -5.0"),   # its unit, not the config's seconds
    ("--tpot-ms 0", "--tpot-ms must be a finite number > 0, got 0.0"),
    ("--default-max-tokens 0", "--default-max-tokens (the default) must be >= 1"),
    ("--migration-limit -1", "--migration-limit must be >= 0"),
    ("--max-worker-restarts -1", "--max-worker-restarts must be >= 0"),
    ("--stop-timeout -1", "--stop-timeout must be >= 0"),
    ("--max-concurrent-streams 0", "--max-concurrent-streams must be >= 1"),
    ("--max-queued-requests -1", "--max-queued-requests must be >= 1"),
    ("--min-ttft-ms 0", "--min-ttft-ms must be > 0"),
    ("--http-receive-timeout-s 0", "--http-receive-timeout-s must be > 0"),
    ("--block-size 0", "--block-size, --max-num-batched-tokens and --max-num-seqs must be >= 1"),
    ("--worker-stall-timeout -1", "--worker-stall-timeout must be >= 0"),
    ("--drain-timeout -1", "--drain-timeout must be >= 0"),
    ("--address head:99999", "--address must be auto, local or [ray://]host:port with a port in 1-65535"),
    ("--address ray://head", "--address must be auto, local or [ray://]host:port"),
    # found by a probe: accepted, then a second bind failed after the start, blamed on that door alone
    ("--port 9400 --metrics-port 9400", "--metrics-port 9400 is the same port as --port"),
    ("--port 8000", "--http-port 8000 is the same port as --port"),
    ("--http-port 9400", "--metrics-port 9400 is the same port as --http-port"),
    ("--port 7000 --metrics-port 7000 --metrics-host 0.0.0.0", "--metrics-port 7000 is the same port as --port"),
    # found by review: host strings were compared, so localhost and 127.0.0.1 were two addresses
    ("--port 7000 --metrics-port 7000 --metrics-host localhost", "--metrics-port 7000 is the same port as --port"),
    ("--served-model-name ", "--served-model-name must not be empty, got ''"),   # a probe: accepted
    ("--served-model-name \t", "--served-model-name must not be empty, got '\\t'"),
    ("--otlp-traces-endpoint not-a-url", "--otlp-traces-endpoint must be an http(s) URL with a host, such as "
                                          "http://127.0.0.1:4318, got 'not-a-url'"),   # a probe: accepted
    ("--otlp-traces-endpoint http://:4318", "--otlp-traces-endpoint must be an http(s) URL with a host"),
    # files, read (and a certificate checked) before Ray starts: found by a probe (tracebacks, or a hang)
    ("--auth-token-file /nonexistent", "/nonexistent: No such file or directory"),
    ("--tls-cert /etc/hostname --tls-key /etc/hostname", "--tls-cert / --tls-key / --tls-client-ca: not a PEM"),
]


@pytest.mark.parametrize("args,message", REFUSED)
def test_serve_refuses_a_config_no_cluster_could_serve_with(args, message, capsys, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray must not start for a refused config"))
    assert main(["serve", *args.split(" ")]) == 2
    assert f"pdserve serve: error: {message}" in capsys.readouterr().err


def test_colocated_mode_runs_without_a_prefill_count_and_port_0_never_collides():
    """The default --num-prefill (none given) is 1 disaggregated, none colocated; 0 colocated says
    what happens anyway. Doors on port 0 (any free port), or on one port at two addresses, are no
    collision."""
    from deploy.cli import _parser, cluster_config

    def config(*flags: str):
        return cluster_config(_parser().parse_args(["serve", "--random-model", *flags]))

    assert config("--mode", "colocated").num_prefill == 0
    assert config("--mode", "colocated", "--num-prefill", "0").num_prefill == 0
    assert config().num_prefill == 1
    assert config("--port", "0", "--http-port", "0", "--metrics-port", "0").doors() == \
        [("port", "127.0.0.1", 0), ("http_port", "127.0.0.1", 0), ("metrics_port", "127.0.0.1", 0)]
    assert config("--port", "9400", "--metrics-host", "127.0.0.2", "--no-http").metrics_port == 9400


def test_client_commands_refuse_a_ca_file_that_is_not_a_pem_certificate(tmp_path, capsys):
    """Found by a probe: `pdserve bench --tls-ca` of a file that is no certificate reported
    UNAVAILABLE (a handshake that never succeeds); now a usage error at once, naming the flag, for
    bench (before it launches or connects to anything) and generate alike; in-process the field."""
    from router.channel import ClientSecurity

    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("hello\n")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--tls-ca", str(not_pem), "--launch", "colocated", "--random-model"])
    assert exit_.value.code == 2
    assert f"pdserve bench: error: --tls-ca {not_pem}: not a PEM certificate" in capsys.readouterr().err
    assert main(["generate", "hi", "--tls-ca", str(not_pem)]) == 2
    assert f"pdserve generate: error: --tls-ca {not_pem}: not a PEM certificate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tls_ca bytes: not a PEM certificate"):
        ClientSecurity.of(tls_ca=b"\xff")


def test_workers_needing_more_cpus_than_ray_has_are_refused_on_an_embedded_ray(caplog):
    """Found by a probe: --num-decode 2 on 2 cores (3 workers x 1 CPU) waited for a placement that
    never came, in silence. Embedded Ray: an error naming the fix; a cluster that may grow: a warning."""
    from deploy.launcher import check_cpus

    check_cpus(2, 1.0, have=2.0, embedded=True)
    with pytest.raises(ValueError, match=r"need 3 CPUs; the Ray cluster has 2: lower --cpus-per-worker \(e.g. 0.67\)"):
        check_cpus(3, 1.0, have=2.0, embedded=True)
    check_cpus(3, 1.0, have=2.0, embedded=False)
    assert "waiting for nodes to join" in caplog.text


def test_client_commands_name_a_file_they_cannot_read(capsys):
    assert main(["generate", "hi", "--tls-ca", "/nonexistent.pem"]) == 2
    assert "pdserve generate: error: /nonexistent.pem: No such file or directory" in capsys.readouterr().err


def test_programmatic_configs_follow_the_same_rules():
    with pytest.raises(ValueError, match="num_decode must be >= 1"):
        ClusterConfig(num_decode=0)
    with pytest.raises(ValueError, match="kv_transport must be one of shm, torch_dist, object_store, cuda_ipc"):
        ClusterConfig(kv_transport="rdma")
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
        EngineConfig(kv_cache_memory_fraction=0)
    assert ClusterConfig(mode="colocated", num_prefill=0).num_prefill == 0   # colocated: decode workers prefill
    with pytest.raises(ValueError, match="metrics_port 9400 is the same port as port"):
        ClusterConfig(port=9400, metrics_port=9400)
    with pytest.raises(ValueError, match="served_model_name must not be empty"):
        ClusterConfig(served_model_name="  ")
    assert EngineConfig(device="cuda:1").dtype == "bfloat16"


def test_generate_and_chat_sampling_flags_become_the_requests_fields():
    """``pdserve generate`` / ``chat`` send the sampling flags as the gRPC request's fields (the
    server validates them, as any client's)."""
    from deploy.cli import _parser, _request_kwargs
    from router.client import build_request

    args = _parser().parse_args(["generate", "hi", "--temperature", "0.7", "--min-p", "0.1", "--min-tokens", "4",
                                 "--repetition-penalty", "1.2", "--frequency-penalty", "0.5",
                                 "--presence-penalty", "-0.5"])
    s = build_request(text="hi", **_request_kwargs(args)).sampling
    assert (s.temperature, s.min_p, s.min_tokens, s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == \
        (0.7, 0.1, 4, 1.2, 0.5, -0.5)
    plain = build_request(text="hi", **_request_kwargs(_parser().parse_args(["chat"]))).sampling
    assert not plain.HasField("min_p") and not plain.HasField("repetition_penalty")


def test_demo_refuses_a_request_count_it_cannot_run(capsys):
    assert main(["demo", "--num-requests", "0"]) == 2
    assert "pdserve demo: error: --num-requests must be >= 1, got 0" in capsys.readouterr().err


def test_a_stop_with_nothing_live_still_says_not_serving_first():
    """Found by a probe: with no live request, SIGTERM went straight to the stop, and health said
    SERVING until the server was gone; the drain (health NOT_SERVING, new requests refused) runs
    all the same, without waiting."""
    import asyncio
    import signal
    from types import SimpleNamespace

    from deploy.cli import _drain

    drained: list[float] = []

    async def drain(timeout_s: float) -> int:
        drained.append(timeout_s)
        return 0

    cluster = SimpleNamespace(servicer=SimpleNamespace(core=SimpleNamespace(live={})), drain=drain)
    asyncio.run(_drain(cluster, 30.0, [signal.SIGTERM], asyncio.Event()))
    assert drained == [0]


def test_a_listen_error_is_said_without_its_errno():
    """Found by a probe: "[Errno 98] the HTTP API cannot listen on ...": the flag's words alone."""
    from deploy.cli import said

    message = "the HTTP API cannot listen on 127.0.0.1:8000 (--http-port): Address already in use"
    assert said(OSError(98, message)) == message
    assert said(FileNotFoundError(2, "No such file or directory", "/x")) == "/x: No such file or directory"
    assert said(ValueError("port must be in [0, 65535]")) == "port must be in [0, 65535]"


def test_the_drain_says_how_to_end_it_in_the_signal_s_words(capsys):
    """A probe: a SIGTERM's drain (systemd's stop) said 'Ctrl-C again stops now'."""
    import asyncio
    import signal
    from types import SimpleNamespace

    from deploy.cli import _drain

    async def drain(timeout_s: float) -> int:
        return 0

    cluster = SimpleNamespace(servicer=SimpleNamespace(core=SimpleNamespace(live={"r": 1})), drain=drain)
    for sig, words in ((signal.SIGTERM, "a second SIGTERM stops now"), (signal.SIGINT, "Ctrl-C again stops now")):
        asyncio.run(_drain(cluster, 30.0, [sig], asyncio.Event()))
        out = capsys.readouterr().out
        assert words in out and f"pdserve: {sig.name}, draining 1 live request(s)" in out, out
