"""A burst of calls while the router's event loop is busy: every call reaches the router's
handler and is answered by it. grpc.aio picks new calls up one at a time on the loop; while the
loop is busy they wait in grpc core, which by default CANCELS calls past 1,000 waiting (all past
3,000) before any handler runs (``router.server.pending_calls_limit`` sizes that backlog to the
router's own stream limit). No Ray, no model: a one-token orchestrator."""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
from types import SimpleNamespace

import grpc

from engine.types import FinishReason, TokenDelta
from router.client import AsyncPdserveClient
from router.limits import ServerLimits
from router.server import pending_calls_limit
from tests.conftest import router_on_a_thread

BURST = 2500          # past grpc core's default soft limit (1,000), where it cancels at random
CHANNELS = 8


class OneTokenOrchestrator:
    """Answers every request with one finished token; counts the requests it saw."""

    def __init__(self) -> None:
        self.registry = SimpleNamespace(all=[])
        self.admission = SimpleNamespace(max_queued=None)
        self.seen = 0

    async def generate(self, spec, trace):
        self.seen += 1
        yield TokenDelta(spec.req_id, (5,), FinishReason.LENGTH)


def test_pending_calls_limit_holds_every_allowed_stream():
    assert pending_calls_limit(256) == 3000                  # grpc's default hard limit at the least
    assert pending_calls_limit(5064) >= 2 * 5064


def test_burst_while_the_loop_is_busy_reaches_the_handler():
    limits = ServerLimits(max_concurrent_streams=BURST + 100)
    orchestrator = OneTokenOrchestrator()
    ctx = mp.get_context("spawn")   # the clients in their own process (one grpc.aio loop per process)
    sent, results = ctx.Event(), ctx.Queue()
    with router_on_a_thread(orchestrator, limits, max_model_len=4096) as router:
        client = ctx.Process(target=burst, args=(f"127.0.0.1:{router.port}", sent, results), daemon=True)
        try:
            router.loop.call_soon_threadsafe(sent.wait, 120)   # the router's loop is busy until every call waits in core
            client.start()
            outcomes = results.get(timeout=300)
        finally:
            sent.set()
            client.join(10)
            if client.is_alive():
                client.kill()
    assert outcomes == {"OK": BURST}, outcomes
    assert orchestrator.seen == BURST


def burst(address: str, sent, results) -> None:
    """The client process: BURST calls at once over CHANNELS connections; their outcomes."""
    results.put(dict(asyncio.run(_burst(address, sent))))


async def _burst(address: str, sent) -> collections.Counter:
    clients = [AsyncPdserveClient(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(CHANNELS)]
    outcomes: collections.Counter = collections.Counter()

    async def one(i: int) -> None:
        try:
            result = await clients[i % CHANNELS].generate_text(token_ids=[5, 6], max_tokens=1)
            outcomes["OK" if result.token_ids == [5] else "wrong tokens"] += 1
        except grpc.aio.AioRpcError as exc:
            outcomes[exc.code().name] += 1

    calls = [asyncio.create_task(one(i)) for i in range(BURST)]
    await asyncio.sleep(3.0)     # every call sent, waiting in the server's core
    sent.set()
    await asyncio.gather(*calls)
    for client in clients:
        await client.close()
    return outcomes


class _GoneContext:
    """A Generate call whose client already left: gRPC core refuses every batch on it
    (``ExecuteBatchError``), which grpc.aio logs at ERROR with a traceback when a handler lets
    it out (one per request when a worker's death ends many requests whose clients cancel)."""

    def __init__(self) -> None:
        self.aborted = []

    async def send_initial_metadata(self, metadata) -> None:
        return None

    async def write(self, message) -> None:
        from grpc._cython import cygrpc

        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')

    async def abort(self, code, details="") -> None:
        from grpc._cython import cygrpc

        self.aborted.append(code)
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return True


def test_a_write_into_a_call_the_client_ended_is_no_error(caplog):
    """The handler sees the client gone (its write refused), logs it once at DEBUG and ends;
    nothing is aborted into the dead call and no error leaves the handler for gRPC to log."""
    import logging

    from router.client import build_request
    from router.convert import ServerDefaults
    from router.server import PdserveServicer, ServerInfo
    from tests.conftest import ByteTokenizer

    servicer = PdserveServicer(OneTokenOrchestrator(), ByteTokenizer(),
                               ServerDefaults(max_model_len=4096, vocab_size=300, limits=ServerLimits()),
                               ServerInfo("fake", "colocated", 16))
    context = _GoneContext()
    with caplog.at_level(logging.DEBUG, logger="router.server"):
        asyncio.run(servicer.Generate(build_request(token_ids=[5, 6], max_tokens=1), context))
    assert context.aborted == []
    lines = [r for r in caplog.records if r.name == "router.server"]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG and lines[0].exc_info is None
