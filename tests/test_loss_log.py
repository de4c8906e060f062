"""A worker's loss is said once for the requests it moved (router.loss_log), the
supervisor's replacement line says what replaced the worker (router.supervisor.replacement), and
health's NOT_SERVING line says why (router.health)."""

from __future__ import annotations

import asyncio
import logging

from router.loss_log import LossLog
from router.supervisor import replacement


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "router.loss_log"]


def test_one_line_per_loss_with_counts_and_examples(caplog):
    async def run():
        log = LossLog(window_s=0.05)
        for i in range(200):
            log.moved("decode-0", 3, f"req{i}", tokens_sent=i % 2)
        log.failed("decode-0", 3, "late")
        log.moved("prefill-0", 1, "other", tokens_sent=0)   # another loss: its own line
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="router.loss_log"):
        asyncio.run(run())
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    decode = next(line for line in lines if "decode-0" in line)
    assert "(generation 3)" in decode and "moved 200 request(s)" in decode and "(100 mid-stream)" in decode
    assert "1 failed (migration limit reached)" in decode and "e.g. req0, req1, req2" in decode
    assert "moved 1 request(s)" in next(line for line in lines if "prefill-0" in line)


def test_moves_after_the_window_open_another_line(caplog):
    async def run():
        log = LossLog(window_s=0.02)
        log.moved("decode-0", 0, "a", tokens_sent=5)
        await asyncio.sleep(0.06)
        log.moved("decode-0", 0, "b", tokens_sent=0)
        await asyncio.sleep(0.06)

    with caplog.at_level(logging.WARNING, logger="router.loss_log"):
        asyncio.run(run())
    assert [("moved 1 request(s)" in line) for line in _lines(caplog)] == [True, True]


def test_replacement_names_a_spare_or_a_cold_start_with_its_pid():
    spare = replacement({"pid": 42, "standby": True, "startup_s": {"load_model": 1.4}})
    assert spare == "a warm spare (pid 42)"   # not the spare's own start-up phases (long before)
    cold = replacement({"pid": 7, "startup_s": {"process_to_init": 11.7, "load_model": 1.4}})
    assert cold == "a cold start (pid 7: process_to_init 11.7 s, load_model 1.4 s)"


def test_a_loss_gives_each_request_its_own_exception():
    """Every request on a lost decode worker re-raises what its queue holds: one shared instance
    grew a traceback frame per raise, and the Nth request's log carried N copies of its frames."""
    from types import SimpleNamespace

    from router.streams import DecodeStreams
    from router.worker_calls import WorkerLost

    async def run():
        worker = SimpleNamespace(worker_id="decode-0", generation=0)
        streams = DecodeStreams(registry=None)
        queues = [streams.register(f"r{i}", worker) for i in range(3)]
        streams._lose(WorkerLost(worker, 0, "it died"))
        return [await q.get() for q in queues]

    items = asyncio.run(run())
    assert all(isinstance(e, WorkerLost) and e.cause == "it died" and e.worker.worker_id == "decode-0" for e in items)
    assert len({id(e) for e in items}) == 3


def test_a_request_failed_by_a_loss_is_logged_in_one_line(caplog):
    """UNAVAILABLE for a loss past the migration limit is an expected ending: its line names the
    cause and the ref once, with no traceback of the router's generators."""
    import grpc

    from engine.errors import WorkerFailedError
    from router.errors import status_for

    try:
        raise WorkerFailedError("worker lost and the migration limit (0) is reached: decode-0 died")
    except WorkerFailedError as exc:
        with caplog.at_level(logging.ERROR, logger="router.errors"):
            code, message = status_for(exc, "req1")
    assert code == grpc.StatusCode.UNAVAILABLE and "(ref " in message
    [record] = [r for r in caplog.records if r.name == "router.errors"]
    assert record.exc_info is None and record.getMessage().count("decode-0 died") == 1, record.getMessage()
    assert "for request req1" in record.getMessage()


def test_health_says_why_it_is_not_serving(caplog):
    """Found by the operations probe: 'health: NOT_SERVING' at ERROR, with no cause."""
    from router.health import ServingHealth

    async def run():
        health = ServingHealth()
        await health.update(True)
        await health.update(False)    # the last decode worker lost
        await health.update(True)
        await health.stopping()

    with caplog.at_level(logging.INFO, logger="router.health"):
        asyncio.run(run())
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "router.health"]
    assert said == [(logging.INFO, "health: SERVING"), (logging.ERROR, "health: NOT_SERVING (no decode worker is up)"),
                    (logging.INFO, "health: SERVING"), (logging.INFO, "health: NOT_SERVING (stopping)")]


def test_a_failure_met_by_many_requests_is_one_line_per_window(caplog):
    """Found by the operations probe: once no decode worker could serve, every request logged
    its own ERROR line (a flood under traffic). Now one line per distinct failure per window:
    the requests meeting it meanwhile share its ref (each client's ref still greps to a line
    saying what failed), and the next line after the window counts them."""
    from router.failure_log import WINDOW_S, FailureLog

    now = [100.0]
    log = FailureLog(logging.getLogger("router.errors"), clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="router.errors"):
        refs = [log.record("unavailable: no decode worker is alive", "WorkerFailedError", f"r{i}") for i in range(50)]
        other = log.record("internal error", "RuntimeError: boom", "x")
        now[0] += WINDOW_S + 1
        later = log.record("unavailable: no decode worker is alive", "WorkerFailedError", "r50")
    lines = [r.getMessage() for r in caplog.records if r.name == "router.errors"]
    assert len(set(refs)) == 1 and other != refs[0] and later != refs[0]
    assert lines[0] == f"unavailable: no decode worker is alive (ref {refs[0]}) for request r0: WorkerFailedError"
    assert lines[1] == f"internal error (ref {other}) for request x: RuntimeError: boom"
    assert lines[2] == (f"unavailable: no decode worker is alive (ref {later}) for request r50: WorkerFailedError; "
                        f"49 more request(s) failed the same way in the 11 s before, answered with ref {refs[0]}")
    assert len(lines) == 3


def test_the_failure_log_keeps_a_bounded_number_of_lines():
    from router.failure_log import MAX_KEYS, FailureLog

    log = FailureLog(logging.getLogger("router.errors.bounded"))
    first = log.record("internal error", "E: 0", "r")
    for i in range(1, MAX_KEYS + 1):
        log.record("internal error", f"E: {i}", "r")
    assert log.record("internal error", "E: 0", "r") != first   # dropped as the oldest: logged afresh
    assert log.record("internal error", f"E: {MAX_KEYS}", "r") == log.record("internal error", f"E: {MAX_KEYS}", "r")
