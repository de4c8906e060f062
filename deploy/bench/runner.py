"""Open-loop runs: requests leave on their arrival schedule whether or not earlier ones finished.

One rate: ``run_rate`` sends each request at its offset (absolute times, so sleeps never drift),
at most ``max_concurrency`` in flight when set (vLLM's ``--max-concurrency``; the wait counts
towards nothing: TTFT starts at the send). It stops sending at ``max_duration_s`` and cancels what
is still running there (those count as failed; the unsent are reported as ``not_sent``). A sweep
runs the same requests at each rate in turn after one warm-up round that is not counted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deploy.bench.backends import FAILED, Backend, RequestOutcome
from deploy.bench.dataset import BenchRequest, arrival_offsets
from deploy.start_failure import first_line

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RateRun:
    request_rate: float
    outcomes: list[RequestOutcome]
    duration_s: float
    num_not_sent: int


async def run_rate(backend: Backend, requests: Sequence[BenchRequest], rate: float, *, burstiness: float = 1.0,
                   seed: int = 0, max_concurrency: int | None = None,
                   max_duration_s: float = math.inf) -> RateRun:
    offsets = arrival_offsets(len(requests), rate, burstiness=burstiness, seed=seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()
    deadline = start + max_duration_s
    tasks: list[asyncio.Task] = []

    async def one(req: BenchRequest) -> RequestOutcome:
        if limit is None:
            return await _timed_send(backend, req, start)
        async with limit:
            return await _timed_send(backend, req, start)

    for req, offset in zip(requests, offsets):
        if start + offset >= deadline:
            break
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    outcomes = await _collect(tasks, requests, deadline)
    duration = time.perf_counter() - start
    return RateRun(rate, outcomes, duration, len(requests) - len(tasks))


async def _timed_send(backend: Backend, req: BenchRequest, start: float) -> RequestOutcome:
    sent = time.perf_counter() - start
    outcome = await backend.send(req)
    outcome.start_s = sent
    return outcome


async def _collect(tasks: list[asyncio.Task], requests: Sequence[BenchRequest],
                   deadline: float) -> list[RequestOutcome]:
    if tasks:
        timeout = None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()   # cancelling the stream aborts the request on the server
        if pending:
            await asyncio.wait(pending)
            logger.warning("%d requests still running at --max-duration-s were cancelled", len(pending))
    outcomes = []
    for req, task in zip(requests, tasks):
        if task.cancelled():
            outcomes.append(RequestOutcome(req.idx, FAILED, req.prompt_len, req.output_len,
                                           error="cancelled at --max-duration-s"))
        elif task.exception() is not None:
            exc = task.exception()
            outcomes.append(RequestOutcome(req.idx, FAILED, req.prompt_len, req.output_len,
                                           error=f"{type(exc).__name__}: {exc}"))
        else:
            outcomes.append(task.result())
    return outcomes


async def warm_up(backend: Backend, requests: Sequence[BenchRequest], *, max_duration_s: float = math.inf) -> None:
    """Send every warm-up request at once and wait, at most ``max_duration_s`` (a server that
    accepts and never answers would hold the run forever); failures are logged, not counted."""
    if not requests:
        return
    tasks = [asyncio.create_task(backend.send(r)) for r in requests]
    outcomes = await _collect(tasks, requests, time.perf_counter() + max_duration_s)
    bad = [o for o in outcomes if not o.ok]
    if bad and len(bad) == len(outcomes):   # not a server this benchmark can drive: say so, run nothing
        raise WarmUpFailed(f"every warm-up request failed, the first with: {first_line(str(bad[0].error))}")
    if bad:
        logger.warning("%d of %d warm-up requests did not complete: %s", len(bad), len(outcomes), bad[0].error)


class WarmUpFailed(RuntimeError):
    """Not one warm-up request completed: the run would only print a table of failures."""
