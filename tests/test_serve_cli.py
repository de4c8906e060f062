"""``pdserve serve`` as a real process (tiny random Llama, embedded Ray): a crash of the whole
process tree leaves /dev/shm pools that the next start reclaims; start-up's heap is frozen out of
garbage collection before it serves; SIGTERM stops it gracefully
(exit 0, no pool left, no Ray process left), first draining: a live request finishes while new
ones get UNAVAILABLE and health says NOT_SERVING, and a second signal ends the drain at once
(the request it cuts gets UNAVAILABLE naming the shutdown); a SIGTERM or SIGINT to the whole
process group (Ray's processes included) stops it in seconds too;
SIGINT or SIGTERM during start-up stops the start (exit 130 / 143), a group SIGTERM as the driver
connects does not abort it; a worker that cannot be built
(a KV pool past the machine's memory) ends the start with one line naming the worker and the cause
as the last thing printed (exit 1, nothing left); the embedded Ray listens on loopback only.

Each run starts in its own session (``start_new_session``), and every process Ray starts stays
in it (checked: GCS, raylet, agents, workers), so "the router's tree" is exactly the processes
of that session; a test kills whatever of it is left, so a failure never leaks a Ray instance.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.embedded_ray_env import EMBEDDED_GCS_RECONNECT_S
from kvtransfer.shm_reclaim import Owner, owner_pid, owner_state
from router.client import PdserveClient

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
READY = re.compile(r"pdserve ready: gRPC on ([\d.]+):(\d+)")
START_TIMEOUT_S = 240      # a loaded 2-core box: Ray ~5 s, two actors a few more, x load
STOP_BOUND_S = 60


def pools() -> set[Path]:
    return set(SHM.glob("pdserve-*.kv"))


def orphaned(since: set[Path]) -> set[Path]:
    """Pools created after the snapshot ``since`` whose owner is gone (other test runs on this
    machine may own live ones)."""
    return {f for f in pools() - since if owner_state(owner_pid(f)) is not Owner.ALIVE}


def session_processes(sid: int) -> list[psutil.Process]:
    """Every live process of session ``sid`` (a run started with ``start_new_session``)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error, PermissionError):
            continue
    return out


class Serve:
    """One ``pdserve serve`` process in its own session, its output read by a thread."""

    def __init__(self, *extra: str) -> None:
        self.pools_before = pools()
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--random-model", "--port", "0", "--metrics-port", "0", "--http-port", "0",
               "--kv-cache-gib", "0.01", "--cpus-per-worker", "0.5", "--threads-per-worker", "1", *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: re.Pattern | str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no {pattern!r} in time (rc {self.proc.poll()}):\n{self.text}")
            m = re.search(pattern, line)
            if m:
                return m

    @property
    def text(self) -> str:
        return "".join(self.output)

    @property
    def session(self) -> list[psutil.Process]:
        """Every live process of this run's session (the CLI, Ray's services, its workers)."""
        return session_processes(self.proc.pid)

    def segments(self) -> set[Path]:
        """KV pools in /dev/shm owned by a live process of this run."""
        pids = {p.pid for p in self.session}
        return {f for f in SHM.glob("pdserve-*.kv") if int(f.name.split("-")[1]) in pids}

    def kill_session(self) -> None:
        """SIGKILL every process of the session: a machine-level crash of the router's tree."""
        procs = self.session
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(30)

    def exit_code(self, timeout_s: float) -> int:
        """The exit status, once the output is read to its end (a failed assertion then shows
        what the process printed last: a traceback after the stop, for one)."""
        code = self.proc.wait(timeout_s)
        self._reader.join(10)
        return code

    def session_gone(self, timeout_s: float) -> bool:
        _, alive = psutil.wait_procs(self.session, timeout=timeout_s)
        return not alive


@pytest.fixture
def runs():
    started: list[Serve] = []
    yield lambda *extra: started.append(Serve(*extra)) or started[-1]
    for run in started:  # whatever a failed test left behind
        run.kill_session()


def address(run: Serve) -> str:
    host, port = run.wait_for(READY, START_TIMEOUT_S).groups()
    return f"{host}:{port}"


def assert_serves(addr: str) -> None:
    with PdserveClient(addr, timeout_s=60) as client:
        assert len(client.generate_text(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True).token_ids) == 4


def listening_addresses(run: Serve) -> set[str]:
    out = set()
    for p in run.session:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        out |= {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def test_crash_leaves_pools_the_next_start_reclaims_and_sigterm_stops_cleanly(runs):
    first = runs()
    assert_serves(address(first))
    crashed = first.segments()
    assert crashed, "the decode worker's pool should be in /dev/shm"
    first.kill_session()
    assert all(f.exists() for f in crashed), ("SIGKILL cannot unlink: the pools must still be there", crashed, [f.exists() for f in crashed])

    second = runs()
    addr = address(second)
    assert not any(f.exists() for f in crashed), "the second start left the first run's pools"
    assert "reclaimed stale KV pool" in second.text
    frozen = re.search(r"(\d+) start-up objects frozen out of garbage collection", second.text)
    assert frozen and int(frozen.group(1)) > 100_000, "start-up's heap should be out of the collector's scans"
    assert_serves(addr)
    # The embedded Ray (and the router, --host default) listen on loopback only.
    bound = listening_addresses(second)
    assert bound and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in bound), bound
    live = second.segments()
    assert live

    second.proc.send_signal(signal.SIGTERM)
    assert second.exit_code(STOP_BOUND_S) == 0, second.text
    assert "SIGTERM, shutting down" in second.text
    assert second.session_gone(30), [p.name() for p in second.session]
    assert not any(f.exists() for f in crashed | live)
    assert not orphaned(first.pools_before)


def assert_start_stopped_by(run: Serve, sig: signal.Signals = signal.SIGINT) -> None:
    started = time.monotonic()
    run.proc.send_signal(sig)
    assert run.exit_code(STOP_BOUND_S) == 128 + sig, run.text
    assert time.monotonic() - started < 30
    assert not READY.search(run.text), f"it finished starting despite the {sig.name}"
    assert f"{sig.name} during start-up" in run.text
    assert run.session_gone(30), [p.name() for p in run.session]
    assert not orphaned(run.pools_before), "a worker killed mid-start left its pool"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_during_start_up_stops_the_start(runs, sig):
    """Sent as Ray logs its start, inside ``ray.init`` (the driver still connecting): Ray's own
    SIGTERM handler (``sys.exit(15)``) is kept out, so SIGTERM is the same cancelled start."""
    run = runs()
    run.wait_for("Started a local Ray instance", START_TIMEOUT_S)  # ~2 s in: Ray up, workers not yet
    assert_start_stopped_by(run, sig)


def test_a_group_sigterm_as_the_driver_connects_does_not_abort(runs):
    """Found by a probe: a SIGTERM to the whole process group in the second after Ray's start
    (the driver's core worker connecting) met Ray's C++ failure-signal handler: a stack printed,
    then SIGABRT. Now the start ends by the signal (143) or, when the raylet it was registering
    with died of it first, by Ray's own exit 1 with one line; nothing is left either way."""
    run = runs()
    run.wait_for("Started a local Ray instance", START_TIMEOUT_S)
    time.sleep(0.3)
    os.killpg(run.proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = run.exit_code(STOP_BOUND_S)
    assert code in (1, 128 + signal.SIGTERM), (code, run.text)
    # When the GCS died first, the driver waits for it no longer than an embedded Ray's bound
    # (deploy/embedded_ray_env.py: 10 s, seen twice in a row), not Ray's 60 s (found by a CI run).
    assert time.monotonic() - signalled < 3 * EMBEDDED_GCS_RECONNECT_S, run.text
    assert "SIGTERM received" not in run.text, run.text
    assert run.session_gone(45), [p.name() for p in run.session]
    assert not orphaned(run.pools_before)


def test_sigint_while_workers_start_tears_them_down(runs):
    run = runs()
    run.wait_for("embedded Ray bound", START_TIMEOUT_S)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not run.segments():  # the decode worker has made its pool: it is mid-construction
        assert time.monotonic() < deadline and run.proc.poll() is None, run.text
        time.sleep(0.05)
    assert_start_stopped_by(run)


def test_a_worker_that_cannot_be_built_ends_the_start_with_one_line_naming_it(runs):
    run = runs("--kv-cache-gib", "100000")    # every worker's pool: far past this machine's memory
    assert run.exit_code(START_TIMEOUT_S) == 1, run.text
    last = run.text.strip().splitlines()[-1]
    assert re.fullmatch(r"pdserve serve: error: (prefill|decode)-0 could not start: \S.*", last), run.text
    assert "allocate" in last or "reserve" in last, last            # the cause: the pool's memory
    assert "Traceback" not in run.text.split("could not start")[-1]
    assert run.session_gone(30), [p.name() for p in run.session]
    assert not orphaned(run.pools_before), "a worker that failed to start left its pool"


def _actor_process(run: Serve, actor_class: str) -> psutil.Process:
    found = [p for p in run.session if actor_class in " ".join(p.cmdline())]
    assert len(found) == 1, [" ".join(p.cmdline()) for p in found]
    return found[0]


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


@contextlib.contextmanager
def _draining_with_a_held_stream(run: Serve, client: PdserveClient, max_tokens: int):
    """A stream with its first tokens read, held live by a suspended decode worker, then SIGTERM:
    the drain is under way. The worker resumes on exit (unless the stop killed it)."""
    decode = _actor_process(run, "DecodeActor")
    stream = client.generate(token_ids=[5, 6, 7], max_tokens=max_tokens, ignore_eos=True)
    got = list(next(stream).token_ids)
    decode.suspend()
    try:
        run.proc.send_signal(signal.SIGTERM)
        run.wait_for("draining 1 live request", 30)
        yield stream, got
    finally:
        if decode.is_running():
            decode.resume()


def test_sigterm_drains_live_requests_and_refuses_new_ones(runs):
    run = runs("--no-standby")
    addr = address(run)
    with PdserveClient(addr, timeout_s=120) as client:
        with _draining_with_a_held_stream(run, client, 64) as (stream, got):
            with pytest.raises(grpc.RpcError) as refused:
                client.generate_text(token_ids=[5, 6], max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "shutting down" in refused.value.details()
            assert _health(addr) == health_pb2.HealthCheckResponse.NOT_SERVING
        got += [t for msg in stream for t in msg.token_ids]
    assert len(got) == 64, "the live request ran to its end"
    assert run.exit_code(STOP_BOUND_S) == 0, run.text
    assert "drained, shutting down" in run.text
    assert run.session_gone(30), [p.name() for p in run.session]
    assert not orphaned(run.pools_before)


def test_a_second_signal_ends_the_drain(runs):
    run = runs("--no-standby", "--stop-timeout", "5")
    with PdserveClient(address(run), timeout_s=120) as client:
        # Long enough that the suspended worker cannot have sent it all before it stopped.
        with _draining_with_a_held_stream(run, client, 400) as (stream, _):
            started = time.monotonic()
            run.proc.send_signal(signal.SIGINT)
            run.wait_for("SIGINT again, stopping now", 10)
            with pytest.raises(grpc.RpcError) as cut:
                list(stream)   # cut by the stop, and told so
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
            assert "shutting down" in cut.value.details(), cut.value.details()
            assert run.exit_code(STOP_BOUND_S) == 0, run.text
            assert time.monotonic() - started < 30, "the stop did not wait out the drain"
    assert run.session_gone(30), [p.name() for p in run.session]
    assert not orphaned(run.pools_before)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_whole_process_group_stops_in_seconds(runs, sig):
    """systemd's default KillMode=control-group, ``kill -TERM -PGID``, supervisord's stopasgroup, a
    terminal's Ctrl-C: the signal reaches the embedded Ray's GCS and raylet too. SIGTERM stops the
    GCS answering at once, and the stop used to wait a minute on it, then exit 1 (found by a probe);
    SIGINT Ray's processes ignore. Either way: exit 0 in seconds, nothing left."""
    run = runs()
    assert_serves(address(run))
    started = time.monotonic()
    os.killpg(run.proc.pid, sig)     # the run's own session: its group is the CLI's pid
    assert run.exit_code(STOP_BOUND_S) == 0, run.text
    assert time.monotonic() - started < 20, f"the stop took {time.monotonic() - started:.0f} s:\n{run.text}"
    assert run.session_gone(30), [p.name() for p in run.session]
    assert not orphaned(run.pools_before), "a pool was left behind"
    if sig is signal.SIGTERM:
        assert "leaving Ray without its shutdown" in run.text, run.text
    assert "Exception in callback" not in run.text, run.text   # a connection handler cancelled at the stop


def test_a_model_that_is_not_there_is_one_line_naming_it():
    """Found by a probe: ``--model /nonexistent`` ended with Ray's coloured task traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--model", "/nonexistent", "--port", "0",
                           "--http-port", "0", "--metrics-port", "0"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=START_TIMEOUT_S, start_new_session=True)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve serve: error: --model /nonexistent: FileNotFoundError: "), done.stderr
    assert "neither a .gguf file nor a directory" in last and "Traceback" not in done.stderr, done.stderr
