"""The grpc.aio front door: validate, tokenize, run through the cluster, stream back.

Life cycle of one Generate call: the message's size limits (``router.limits``, before any
tokenizer runs) -> claim its identity (``router.identity``: the router's own request id; the
client's request_id is a label, one live call per label, ALREADY_EXISTS otherwise; at most
``max_concurrent_streams`` live) -> token ids (text, chat template or ids; tokenizing runs on a
small thread pool, never on the event loop) -> validated RequestSpec (INVALID_ARGUMENT on any
problem, nothing queued) -> admission (RESOURCE_EXHAUSTED when refused) -> Orchestrator streams
TokenDeltas -> incremental UTF-8 safe text -> one GenerateResponse per (possibly merged) delta;
the last carries finish reason, usage and timings. Client cancel or deadline cancels the
handler; the orchestrator's cleanup aborts the request on every worker. A client that stops
reading is cancelled once ``max_pending_tokens`` wait for it (``router.delta_queue``).
Every error leaves through ``router.errors`` (never UNKNOWN, never a worker's text). All of
that but the wire format is ``router.generation.GenerationCore``, which the OpenAI-compatible
HTTP API (``router.openai_api``) shares. Also serves ServerInfo (fresh worker stats),
grpc.health.v1 and server reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine import tracing
from engine.types import WorkerStats
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router import convert, errors
from router.convert import ServerDefaults
from router.generation import GenerationCore, GenerationEvent, MalformedRequest
from router.health import PDSERVE_SERVICE, ServingHealth
from router.identity import RequestIdentity
from router.listen import cannot_listen
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.security import ServerSecurity

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 1.0       # ServerInfo's fresh-stats call per worker; a slower one shows its last report
GRPC_DEFAULT_PENDING_HARD_LIMIT = 3000   # grpc core's own default for calls not yet picked up


def pending_calls_limit(max_concurrent_streams: int) -> int:
    """How many calls grpc core may hold before the event loop picks them up. grpc.aio takes
    new calls one at a time on the loop, so while the loop is busy they wait in core; past its
    defaults (1,000, then 3,000) core CANCELS new calls before any handler runs, and the client
    sees a CANCELLED it never asked for (thousands of them at 5,000 streams: the retries refill
    the backlog). Load is refused by the router's own limits (``max_concurrent_streams``, the
    admission queue) with RESOURCE_EXHAUSTED; core's backlog only holds a burst of such calls,
    so it is sized to hold every allowed stream twice over."""
    return max(GRPC_DEFAULT_PENDING_HARD_LIMIT, 2 * max_concurrent_streams)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    mode: str          # "disaggregated" | "colocated"
    block_size: int


def _lenient(parse):
    """Request deserializer that lets the handler answer INVALID_ARGUMENT for bytes that do not
    parse (grpc.aio would answer INTERNAL before any handler ran)."""

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(str(exc))

    return deserialize


class PdserveServicer(pb_grpc.PdserveServicer):
    """The gRPC front door over ``GenerationCore`` (shared with the HTTP API: ``self.core``)."""

    def __init__(self, orchestrator: Orchestrator, tokenizer: Any | None, defaults: ServerDefaults,
                 info: ServerInfo, metrics: RouterMetrics | None = None) -> None:
        self.core = GenerationCore(orchestrator, tokenizer, defaults, metrics)   # owns what both doors share
        self.info = info

    @property
    def live(self):
        return self.core.live

    @property
    def tokenizer(self) -> Any | None:
        return self.core.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any | None) -> None:   # tests swap in a byte tokenizer: both doors see it
        self.core.tokenizer = tokenizer

    # ---- Generate ---------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes with ``context.write`` (not ``yield``) so a write cancelled because the client
        stopped reading is seen here and answered.

        The headers go first, on their own, before the request's queue exists: grpc.aio marks
        them sent only once a write completes, so a slow-reader cancel that lands in the first
        write (still pending in core) would make the abort send them again, a batch core
        refuses (TOO_MANY_OPERATIONS): no status would leave and the client would wait for its
        deadline. With them sent, an abort is a status batch alone, which core takes while a
        write is pending (the status follows the message once the client reads). Their send
        (a round trip through gRPC core) runs while the request is tokenized, admitted and
        dispatched; the first write and any abort wait for it to complete."""
        identity: RequestIdentity | None = None
        headers: _Headers | None = None
        try:
            identity = await self.core.claim(request)
            headers = _Headers(context)
            client_trace = tracing.client_context(context.invocation_metadata() or ())
            async with contextlib.aclosing(self.core.stream(request, identity, trace_context=client_trace)) as events:
                async for event in events:
                    await headers.sent()
                    await context.write(_response(event, identity.label))
        except asyncio.CancelledError as exc:
            ours = self.core.server_cancel(exc)   # a slow reader, or cut at the stop
            if ours is None:
                raise   # the client cancelled or its deadline passed
            await self._abort(context, ours, identity, headers)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # typed ones map to their codes; anything else is INTERNAL, never UNKNOWN
            await self._abort(context, exc, identity, headers)
        finally:
            self.core.release(identity)

    async def _abort(self, context, exc: BaseException, identity: RequestIdentity | None,
                     headers: _Headers | None = None) -> None:
        if context.done():
            # The call ended first (the client cancelled or left, e.g. as a worker's death ended
            # its request): no status can reach it, and gRPC core refuses the write that found
            # out (ExecuteBatchError). Not an internal error: one debug line, no abort.
            logger.debug("%s: the call ended before its outcome could be sent (%s: %s)",
                         identity.req_id if identity else "-", type(exc).__name__, exc)
            return
        if headers is not None:
            with contextlib.suppress(Exception):   # failed: the call is over, the abort says so
                await headers.sent()
        retry_s = errors.retry_after_s(exc)   # gRPC's retry policy waits this long (server pushback)
        pushback = (("grpc-retry-pushback-ms", str(round(retry_s * 1000))),) if retry_s is not None else ()
        await context.abort(*self.core.failure(exc, identity), trailing_metadata=pushback)

    # ---- ServerInfo -------------------------------------------------------------------------
    async def ServerInfo(self, request: pb.ServerInfoRequest | MalformedRequest, context) -> pb.ServerInfoResponse:
        try:
            if isinstance(request, MalformedRequest):   # INVALID_ARGUMENT, as Generate answers it (not UNKNOWN)
                raise request.refusal("ServerInfoRequest")
            statuses = await self._fresh_statuses()
            return convert.server_info_to_proto(
                self.core.defaults, model=self.info.model, block_size=self.info.block_size, mode=self.info.mode,
                statuses=statuses)
        except Exception as exc:
            await self._abort(context, exc, None)

    async def _fresh_statuses(self) -> list[convert.WorkerStatus]:
        """Every worker's state and its stats now (blocks released between steps included), not
        the last ones seen with a step; a worker that does not answer in time shows its last
        report, one that is down none."""
        workers = self.core.orchestrator.registry.all
        fresh = await asyncio.gather(*(self._stats_of(w) for w in workers))
        on_stats = self.core.orchestrator.on_stats   # the KV gauges and admission take them too
        for worker, stats in zip(workers, fresh):   # (a prefill worker reports only with results)
            if stats is not None and stats is not worker.stats:
                worker.observe_stats(stats)
                if on_stats is not None:
                    on_stats(worker)
        return [convert.WorkerStatus(w.worker_id, w.role, w.state.value, w.restarts, stats)
                for w, stats in zip(workers, fresh)]

    @staticmethod
    async def _stats_of(worker) -> WorkerStats | None:
        if not worker.alive:
            return None
        try:
            return await asyncio.wait_for(worker.actor.stats.remote(), STATS_TIMEOUT_S)
        except Exception as exc:
            logger.debug("stats of %s: %s; using its last report", worker.worker_id, exc)
            return worker.stats

    def close(self) -> None:
        self.core.close()


class _Headers:
    """A Generate call's response headers, on their way while the request goes to the cluster.

    grpc.aio adds the headers to a write or an abort until their own send has completed, and
    core refuses a second headers batch while the first is pending (no status would leave):
    so ``sent`` is awaited before the first write and before any abort. Shielded: a cancel of
    the handler while it waits here must not cancel the send itself."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._send = asyncio.ensure_future(context.send_initial_metadata(()))
        self._send.add_done_callback(_seen)

    async def sent(self) -> None:
        if not self._send.done():
            await asyncio.shield(self._send)
        elif self._send.exception() is not None:
            raise self._send.exception()


def _seen(task: asyncio.Future) -> None:
    """A send that failed because the client left is read here (no 'never retrieved' warning)."""
    if not task.cancelled():
        task.exception()


def _response(event: GenerationEvent, label: str) -> pb.GenerateResponse:
    # Named by the client's label: the router's own id never leaves it.
    return convert.delta_to_proto(event.delta, event.text, usage=event.usage, timings=event.timings, request_id=label)


def _add_servicer(servicer: PdserveServicer, server: grpc.aio.Server) -> None:
    """``pb_grpc.add_PdserveServicer_to_server`` with a lenient request deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest.FromString),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ServerInfo, request_deserializer=_lenient(pb.ServerInfoRequest.FromString),
            response_serializer=pb.ServerInfoResponse.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Pdserve"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


async def start_server(servicer: PdserveServicer, host: str, port: int,
                       security: ServerSecurity | None = None, health: ServingHealth | None = None,
                       serving: bool = True) -> tuple[grpc.aio.Server, int]:
    """Create (inside the running loop, as grpc.aio requires) and start the server; ``security``
    adds TLS / mTLS on the port and the bearer-token interceptor (``router/security.py``);
    ``health`` (made here when not given) starts at ``serving``."""
    security = security or ServerSecurity()
    limits = servicer.core.limits
    pending = pending_calls_limit(limits.max_concurrent_streams)
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limits.max_receive_message_bytes),
        ("grpc.server.max_pending_requests", pending),        # no random CANCELLED below the hard limit
        ("grpc.server.max_pending_requests_hard_limit", pending),
    ], interceptors=security.interceptors())
    _add_servicer(servicer, server)
    health = health or ServingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    names = (PDSERVE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    credentials = security.credentials()
    if credentials is None:
        bound = _listen(server.add_insecure_port, host, port)
    else:
        bound = _listen(lambda address: server.add_secure_port(address, credentials), host, port)
    await server.start()
    await health.update(serving)
    logger.info("router listening on %s:%d (%s)", host, bound, security.describe())
    return server, bound


def _listen(add_port, host: str, port: int) -> int:
    """``add_port(address)``, its failure said as an OSError naming the flag (gRPC raises a
    RuntimeError that names neither the cause nor the option), as the other two doors say theirs."""
    try:
        return add_port(f"{host}:{port}")
    except RuntimeError:
        raise cannot_listen("port", host, port, "the port is in use, or the address is not this machine's") from None
