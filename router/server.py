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
Every error leaves through ``router.errors`` (never UNKNOWN, never a worker's text). Also
serves ServerInfo (fresh worker stats), grpc.health.v1 and server reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import CapacityError, InvalidRequestError, PdserveError
from engine.types import FinishReason, RequestSpec, TokenDelta, WorkerStats
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router import convert, limits as request_limits
from router.convert import IncrementalDetokenizer, ServerDefaults, Usage
from router.health import PDSERVE_SERVICE, ServingHealth
from router.delta_queue import MAX_PENDING_TOKENS, SLOW_READER, SlowReaderError
from router.errors import RequestFailedError, status_for
from router.identity import LiveRequests, RequestIdentity
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, RequestTrace
from router.security import ServerSecurity

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 2       # HF fast tokenizers release the GIL: two prompts tokenize at once
STATS_TIMEOUT_S = 1.0       # ServerInfo's fresh-stats call per worker; a slower one shows its last report


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    mode: str          # "disaggregated" | "colocated"
    block_size: int


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """A GenerateRequest that did not parse (e.g. invalid UTF-8 in a string field)."""

    error: str


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
    def __init__(self, orchestrator: Orchestrator, tokenizer: Any | None, defaults: ServerDefaults,
                 info: ServerInfo, metrics: RouterMetrics | None = None) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.limits = defaults.limits
        self.info = info
        self.metrics = metrics
        self.live = LiveRequests(self.limits.max_concurrent_streams)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pdserve-tokenize")
        # The admission queue's cap is a server limit; admission is built before the servicer.
        orchestrator.admission.max_queued = self.limits.max_queued_requests

    # ---- Generate ---------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes with ``context.write`` (not ``yield``) so a write cancelled because the client
        stopped reading is seen here and answered."""
        identity: RequestIdentity | None = None
        try:
            identity = self._admit_call(request)
            await self._generate(request, identity, context)
        except asyncio.CancelledError as exc:
            if exc.args[:1] != (SLOW_READER,):
                raise   # the client cancelled or its deadline passed
            asyncio.current_task().uncancel()
            await self._abort(context, SlowReaderError(f"max_pending_tokens: the client left more than "
                                                       f"{self.limits.max_pending_tokens} tokens unread"), identity)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # typed ones map to their codes; anything else is INTERNAL, never UNKNOWN
            await self._abort(context, exc, identity)
        finally:
            if identity is not None:
                self.live.release(identity)

    def _admit_call(self, request) -> RequestIdentity:
        """Cheap checks, before any tokenizer runs: the message parsed, its sizes, its label."""
        if isinstance(request, MalformedRequest):
            raise InvalidRequestError("request", f"not a valid GenerateRequest ({request.error}); "
                                                 "string fields must be valid UTF-8")
        request_limits.check_request(request, self.limits)
        return self.live.claim(convert.label_from_proto(request))

    async def _generate(self, request: pb.GenerateRequest, identity: RequestIdentity, context) -> None:
        spec = await self._spec(request, identity.req_id)
        trace = RequestTrace()
        detok = self._detokenizer(request, spec)
        outcome: FinishReason | str = FinishReason.ABORT  # until the stream says otherwise
        MAX_PENDING_TOKENS.set(self.limits.max_pending_tokens)  # read by the request's DeltaQueue
        try:
            async with contextlib.aclosing(self.orchestrator.generate(spec, trace)) as deltas:
                async for delta in deltas:
                    trace.on_tokens(len(delta.token_ids))
                    if delta.finish_reason is FinishReason.ERROR:
                        outcome = FinishReason.ERROR
                        raise RequestFailedError(delta.error or "the worker failed the request")
                    if delta.finished:
                        outcome = delta.finish_reason
                    await context.write(self._response(delta, detok, spec, trace, identity.label))
        except CapacityError as exc:   # refused by admission (a slow reader is an abort)
            outcome = FinishReason.ABORT if isinstance(exc, SlowReaderError) else "rejected"
            raise
        except Exception:
            outcome = FinishReason.ERROR
            raise
        finally:
            self._record(spec, trace, outcome)

    async def _abort(self, context, exc: BaseException, identity: RequestIdentity | None) -> None:
        code, message = status_for(exc, identity.req_id if identity else "")
        if self.metrics is not None and code is grpc.StatusCode.INVALID_ARGUMENT:
            self.metrics.request_invalid()
        await context.abort(code, message)

    def _record(self, spec: RequestSpec, trace: RequestTrace, outcome: FinishReason | str) -> None:
        if self.metrics is None:
            return
        if outcome == "rejected":
            self.metrics.request_rejected("capacity")
            return
        times = trace.token_times
        itls = [b - a for a, b in zip(times, times[1:])]
        self.metrics.request_finished(
            outcome, trace.timings(), len(spec.prompt_token_ids), len(times), itls,
            spec.slo.ttft_s, spec.slo.tpot_s, transport=trace.transport or None,
        )

    async def _spec(self, request: pb.GenerateRequest, req_id: str) -> RequestSpec:
        kind = request.WhichOneof("prompt")
        if kind == "chat":
            convert.chat_from_proto(request.chat)  # malformed messages are named before anything else
        if kind in ("text", "chat") and self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token_ids")
        if kind in ("text", "chat"):   # tokenizing a long prompt takes a while: off the event loop
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._tokenize_pool, self._tokenized_spec, request, req_id)
        prompt = convert.prompt_from_proto(request, self.tokenizer)
        return convert.spec_from_proto(request, prompt, self.defaults, req_id)

    def _tokenized_spec(self, request: pb.GenerateRequest, req_id: str) -> RequestSpec:
        """On the tokenizer pool: tokenize, then validate the ids there too (per-token work)."""
        prompt = convert.prompt_from_proto(request, self.tokenizer)
        return convert.spec_from_proto(request, prompt, self.defaults, req_id)

    def _detokenizer(self, request, spec: RequestSpec) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        skip = convert.skip_special_tokens_from_proto(request)
        return IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids, skip_special_tokens=skip)

    def _response(self, delta: TokenDelta, detok, spec: RequestSpec, trace: RequestTrace, label: str) -> pb.GenerateResponse:
        text = detok.push(delta.token_ids, finished=delta.finished) if detok else ""
        usage = timings = None
        if delta.finished:
            usage = Usage(prompt_tokens=len(spec.prompt_token_ids), completion_tokens=len(trace.token_times))
            timings = trace.timings()
        msg = convert.delta_to_proto(delta, text, usage=usage, timings=timings)
        msg.request_id = label   # the client's label; the router's own id never leaves it
        return msg

    # ---- ServerInfo -------------------------------------------------------------------------
    async def ServerInfo(self, request: pb.ServerInfoRequest, context) -> pb.ServerInfoResponse:
        try:
            statuses = await self._fresh_statuses()
            return convert.server_info_to_proto(
                self.defaults, model=self.info.model, block_size=self.info.block_size, mode=self.info.mode,
                statuses=statuses)
        except Exception as exc:
            await self._abort(context, exc, None)

    async def _fresh_statuses(self) -> list[convert.WorkerStatus]:
        """Every worker's state and its stats now (blocks released between steps included), not
        the last ones seen with a step; a worker that does not answer in time shows its last
        report, one that is down none."""
        workers = self.orchestrator.registry.all
        fresh = await asyncio.gather(*(self._stats_of(w) for w in workers))
        if self.metrics is not None:   # the KV gauges too (a prefill worker reports only with results)
            for stats in fresh:
                if stats is not None:
                    self.metrics.update_worker(stats)
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
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)


def _add_servicer(servicer: PdserveServicer, server: grpc.aio.Server) -> None:
    """``pb_grpc.add_PdserveServicer_to_server`` with a lenient request deserializer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest.FromString),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ServerInfo, request_deserializer=pb.ServerInfoRequest.FromString,
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
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", servicer.limits.max_receive_message_bytes),
    ], interceptors=security.interceptors())
    _add_servicer(servicer, server)
    health = health or ServingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    names = (PDSERVE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    credentials = security.credentials()
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    await server.start()
    await health.update(serving)
    logger.info("router listening on %s:%d (%s)", host, bound, security.describe())
    return server, bound
