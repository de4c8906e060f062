"""The grpc.aio front door: validate, tokenize, run through the cluster, stream back.

Life cycle of one Generate call: proto -> token ids (text, chat template or ids) ->
validated RequestSpec (INVALID_ARGUMENT on any problem, nothing queued) -> admission
(RESOURCE_EXHAUSTED when refused) -> Orchestrator streams TokenDeltas -> incremental UTF-8
safe text -> one GenerateResponse per delta; the last carries finish reason, usage and
timings. Client cancel or deadline cancels the handler; the orchestrator's cleanup aborts the
request on every worker. Also serves ServerInfo, grpc.health.v1 and server reflection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidRequestError, PdserveError
from engine.types import FinishReason, RequestSpec, TokenDelta
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router import convert
from router.convert import IncrementalDetokenizer, ServerDefaults, Usage
from router.errors import status_for
from router.health import PDSERVE_SERVICE, ServingHealth
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, RequestTrace
from router.security import ServerSecurity

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    mode: str          # "disaggregated" | "colocated"
    block_size: int


class PdserveServicer(pb_grpc.PdserveServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer: Any | None, defaults: ServerDefaults,
                 info: ServerInfo, metrics: RouterMetrics | None = None) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.info = info
        self.metrics = metrics

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            spec = self._spec(request)
        except InvalidRequestError as exc:
            if self.metrics:
                self.metrics.request_invalid()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        trace = RequestTrace()
        detok = self._detokenizer(request, spec)
        outcome: FinishReason | str = FinishReason.ABORT  # until the stream says otherwise
        try:
            async for delta in self.orchestrator.generate(spec, trace):
                trace.on_tokens(len(delta.token_ids))
                if delta.finish_reason is FinishReason.ERROR:
                    outcome = FinishReason.ERROR
                    await context.abort(grpc.StatusCode.INTERNAL, delta.error or "the worker failed")
                if delta.finished:
                    outcome = delta.finish_reason
                yield self._response(delta, detok, spec, trace)
        except PdserveError as exc:
            code, message = status_for(exc)
            outcome = "rejected" if code is grpc.StatusCode.RESOURCE_EXHAUSTED else FinishReason.ERROR
            await context.abort(code, message)
        finally:
            self._record(spec, trace, outcome)

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

    def _spec(self, request: pb.GenerateRequest) -> RequestSpec:
        req_id = convert.req_id_from_proto(request)
        kind = request.WhichOneof("prompt")
        if kind == "chat":
            convert.chat_from_proto(request.chat)  # malformed messages are named before anything else
        if kind != "token_ids" and self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token_ids")
        prompt = convert.prompt_from_proto(request, self.tokenizer)
        return convert.spec_from_proto(request, prompt, self.defaults, req_id)

    def _detokenizer(self, request, spec: RequestSpec) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        skip = convert.skip_special_tokens_from_proto(request)
        return IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids, skip_special_tokens=skip)

    def _response(self, delta: TokenDelta, detok, spec: RequestSpec, trace: RequestTrace) -> pb.GenerateResponse:
        text = detok.push(delta.token_ids, finished=delta.finished) if detok else ""
        if not delta.finished:
            return convert.delta_to_proto(delta, text)
        usage = Usage(prompt_tokens=len(spec.prompt_token_ids), completion_tokens=len(trace.token_times))
        return convert.delta_to_proto(delta, text, usage=usage, timings=trace.timings())

    async def ServerInfo(self, request: pb.ServerInfoRequest, context) -> pb.ServerInfoResponse:
        statuses = [convert.WorkerStatus(w.worker_id, w.role, w.state.value, w.restarts, w.stats if w.alive else None)
                    for w in self.orchestrator.registry.all]
        return convert.server_info_to_proto(
            self.defaults, model=self.info.model, block_size=self.info.block_size, mode=self.info.mode,
            statuses=statuses,
        )


async def start_server(servicer: PdserveServicer, host: str, port: int,
                       security: ServerSecurity | None = None, health: ServingHealth | None = None,
                       serving: bool = True) -> tuple[grpc.aio.Server, int]:
    """Create (inside the running loop, as grpc.aio requires) and start the server; ``security``
    adds TLS / mTLS on the port and the bearer-token interceptor (``router/security.py``);
    ``health`` (made here when not given) starts at ``serving``."""
    security = security or ServerSecurity()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=security.interceptors())
    pb_grpc.add_PdserveServicer_to_server(servicer, server)
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
