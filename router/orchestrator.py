"""Runs one request through the cluster and yields its token deltas.

Life cycle (disaggregated):
  admission picks the (prefill, decode) pair (or refuses / queues) -> register for the decode
  worker's stream -> decode ``reserve``s blocks -> prefill worker prefills, moves the KV,
  decode ``commit``s -> first token yielded -> the rest arrive through the decode worker's
  batched stream -> finish.
Colocated mode, or conditional disaggregation choosing it: the decode worker runs the whole
request. If the hand-off fails the request is recomputed on its decode worker (never decoded
from garbage). On cancel, deadline or error the request is aborted on the prefill worker
first (its ``abort`` returns once it can no longer write into the reserved blocks) and then on
the decode worker, so every block on both sides is freed. Worker deaths surface as
WorkerFailedError.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ray.exceptions import RayActorError

from engine.errors import WorkerFailedError
from engine.types import FinishReason, PrefillResult, RequestSpec, TokenDelta
from router.admission import Admission, Prediction
from router.convert import RequestTimings
from router.registry import DecodeProgress, WorkerHandle, WorkerRegistry
from router.streams import DecodeStreams

logger = logging.getLogger(__name__)

MIN_TOKENS_FOR_TPOT = 8   # a shorter output's TPOT says little about the prediction


@dataclass(slots=True)
class RequestTrace:
    """Per-request stamps (router clock) that become the client's timings and the metrics."""

    start_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    prefill: PrefillResult | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    transport: str = ""
    recomputed: bool = False

    def on_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now
        self.token_times.extend([now] * n)
        self.last_token_s = now

    def timings(self) -> RequestTimings:
        end = self.last_token_s or time.perf_counter()
        ttft = (self.first_token_s or end) - self.start_s
        n = len(self.token_times)
        tpot = (end - self.first_token_s) / (n - 1) if n > 1 and self.first_token_s else 0.0
        p = self.prefill
        return RequestTimings(
            queue_s=p.queue_s if p else 0.0,
            prefill_s=p.prefill_s if p else 0.0,
            kv_transfer_s=p.transfer_s if p else 0.0,
            decode_s=end - (self.first_token_s or end),
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=end - self.start_s,
            kv_transfer_bytes=p.transfer_bytes if p else 0,
            prefill_worker_id=self.prefill_worker,
            decode_worker_id=self.decode_worker,
        )


class Orchestrator:
    def __init__(self, registry: WorkerRegistry, streams: DecodeStreams, admission: Admission,
                 metrics: Any | None = None) -> None:
        self.registry = registry
        self.streams = streams
        self.admission = admission
        self.metrics = metrics
        self._cleanups: set[asyncio.Task] = set()

    async def generate(self, spec: RequestSpec, trace: RequestTrace) -> AsyncIterator[TokenDelta]:
        pair = await self.admission.acquire(spec, self.metrics)
        prefill, decode = pair.prefill, pair.decode
        trace.decode_worker = decode.worker_id
        trace.prefill_worker = prefill.worker_id if prefill else ""
        queue = self.streams.register(spec.req_id, decode)
        num_prompt = len(spec.prompt_token_ids)
        prefiller = prefill or decode   # whoever prefills carries the prompt until its first token
        prefiller.begin_prefill(num_prompt)
        prefill_pending = True
        progress = decode.decoding[spec.req_id] = DecodeProgress(spec.sampling.max_tokens, spec.slo.tpot_s,
                                                                 prefill_mark=decode.prefill_tokens_sent)
        finished = False
        try:
            first = await self._start(spec, prefill, decode, trace)
            prefill = None   # its part is done: nothing left there to abort
            if first is not None:
                prefiller.end_prefill(num_prompt)
                prefill_pending = False
                self._observed_ttft(pair, trace)
                self._decoding(decode, progress, len(first.token_ids))
                yield first
                finished = first.finished
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if prefill_pending and item.token_ids:
                    prefiller.end_prefill(num_prompt)
                    prefill_pending = False
                    self._observed_ttft(pair, trace)
                self._decoding(decode, progress, len(item.token_ids))
                finished = item.finished
                yield item
        except RayActorError as exc:
            raise WorkerFailedError(f"a worker died: {exc}") from exc
        finally:
            self.streams.unregister(spec.req_id)
            decode.decoding.pop(spec.req_id, None)
            if prefill_pending:
                prefiller.end_prefill(num_prompt)
            if not finished:
                self._abort_later(spec.req_id, prefill, decode)
            elif len(trace.token_times) >= MIN_TOKENS_FOR_TPOT:
                self._observed_tpot(pair, progress, trace.timings().tpot_s)
            self._capacity_changed()

    def _decoding(self, decode: WorkerHandle, progress: DecodeProgress, num_tokens: int) -> None:
        first = progress.first_token_s is None and num_tokens > 0
        progress.on_tokens(num_tokens)
        if first:
            self.admission.expect_tpot(decode, progress)

    def _observed_tpot(self, pair: Prediction, progress: DecodeProgress, observed_s: float) -> None:
        self.admission.observe_tpot(progress, observed_s)
        if self.metrics is not None:
            self.metrics.prediction("tpot", pair.tpot_s, observed_s)

    def _observed_ttft(self, pair: Prediction, trace: RequestTrace) -> None:
        observed = time.perf_counter() - trace.start_s
        self.admission.observe_ttft(pair, observed)
        if self.metrics is not None:
            self.metrics.prediction("ttft", pair.ttft_s, observed)

    async def _start(self, spec, prefill, decode, trace) -> TokenDelta | None:
        """Get the request running on its decode worker; return the first token if known here."""
        if prefill is None:
            await _call(decode, decode.actor.add_request.remote(spec))
            return None
        transport = trace.transport = self.registry.transport(prefill, decode)
        # Reserve and prefill start together; the prefill worker awaits the handle only when its
        # KV is ready (wrapped in a list so Ray passes the ref instead of resolving it first).
        handle_ref = decode.actor.reserve.remote(spec, transport)
        result: PrefillResult = await _call(prefill, prefill.actor.prefill.remote(spec, [handle_ref], decode.actor))
        trace.prefill = result
        self._observe_prefill(prefill, result)
        if result.error and result.error.startswith("decode reservation failed"):
            await _call(decode, handle_ref)  # raises the reservation's own error (e.g. CapacityError)
        if result.finish_reason is FinishReason.ERROR and result.error and "KV transfer" in result.error:
            return await self._recompute(spec, decode, trace, result.error)
        if result.finish_reason is not None:
            await _call(decode, decode.actor.abort.remote(spec.req_id))  # free the unused reservation
        return TokenDelta(spec.req_id, _first(result), result.finish_reason,
                          (result.first_logprob,) if result.first_logprob is not None else None, result.error)

    def _observe_prefill(self, prefill: WorkerHandle, result: PrefillResult) -> None:
        if result.stats is not None:
            prefill.stats = result.stats
            self.admission.observe_stats(prefill)
            if self.metrics is not None:
                self.metrics.update_worker(result.stats)
        if result.transfer_bytes:
            self.admission.observe_handoff(result.transfer_s)

    def _capacity_changed(self) -> None:
        asyncio.get_running_loop().create_task(self.admission.notify())

    async def _recompute(self, spec, decode, trace, error: str) -> None:
        logger.warning("%s: %s; recomputing on %s", spec.req_id, error, decode.worker_id)
        await _call(decode, decode.actor.abort.remote(spec.req_id))
        trace.recomputed = True
        await _call(decode, decode.actor.add_request.remote(spec))
        return None

    def _abort_later(self, req_id: str, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        """Runs outside the (possibly cancelled) handler so the aborts always complete."""
        task = asyncio.get_running_loop().create_task(self._abort(req_id, prefill, decode))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort(self, req_id: str, prefill: WorkerHandle | None, decode: WorkerHandle) -> None:
        for worker in (prefill, decode):  # prefill first: then nothing can still write the blocks
            if worker is None or not worker.alive:
                continue
            try:
                await worker.actor.abort.remote(req_id)
            except Exception as exc:
                logger.warning("abort of %s on %s failed: %s", req_id, worker.worker_id, exc)

    async def drain_cleanups(self) -> None:
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)


async def _call(worker: WorkerHandle, ref):
    """Await a worker call; a dead actor marks the worker dead and becomes WorkerFailedError."""
    try:
        return await ref
    except RayActorError as exc:
        worker.alive = False
        raise WorkerFailedError(f"worker {worker.worker_id} died: {exc}") from exc


def _first(result: PrefillResult) -> tuple[int, ...]:
    return (result.first_token_id,) if result.first_token_id is not None else ()
