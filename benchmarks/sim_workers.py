"""Simulated prefill and decode workers: the router at scale without a model (benchmarks, fast tests).

Not a feature and never served: these stand in for the Ray actors so that the real router
(admission, pair choice, decode-stream demux, orchestration, metrics, gRPC) can be driven at a
scale this machine cannot run (``benchmarks/bench_router_scale.py``: 16 + 48 workers, 5,000
streams). They answer the same methods with the same dataclasses as ``prefill_worker/actor.py``
and ``decode_worker/actor.py`` (``reserve`` -> ``KVBlocksHandle``, ``prefill`` ->
``PrefillResult``, ``stream`` -> ``StreamBatch`` per step, ``stats`` -> ``WorkerStats`` with
``StepTiming``s, ``leak_report``), and take the same time as the real engine would: every step
lasts what a ``StepTimeModel`` fitted to the real engine's step timings predicts for its shape
(``SimSpeed``; ``benchmarks/step_timings.py`` records those timings).

Life cycle of a request, as on the real workers:
  prefill worker queues the prompt and calls the decode worker's ``reserve`` (prompt blocks
  taken, request parked; ``CapacityError`` without room), its loop prefills up to
  ``max_num_batched_tokens`` per step (step time = tokens x the fitted seconds per prefill
  token) -> first token -> awaits the reservation, decode ``commit`` -> ``PrefillResult`` (OK,
  or RESERVE_REFUSED / RESERVE_FAILED / ENDED_AT_PREFILL / ABORTED) -> the decode worker's one
  loop steps every running request at once (step time = the fitted decode step for that batch
  and KV size, plus local prefill tokens when it prefills a request itself: ``add_request``)
  and publishes one ``StreamBatch`` per step with its stats -> finished at ``max_tokens``
  (LENGTH; EOS is not simulated) -> blocks freed. ``abort`` frees at once (there is no real
  writer to fence against). Each worker runs one loop: no work per token per request beyond
  building that request's ``TokenDelta``.
Token ids are a function of the prompt and position (``sim_token``), so a client can check
every token it was sent. Loop-agnostic: ``benchmarks/sim_cluster.py`` runs them on a thread of
their own behind Ray-like actor handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from engine.errors import CapacityError, InvalidRequestError, KVTransferError
from engine.types import (FinishReason, HandoffOutcome, KVLayout, PrefillResult, RequestSpec, StepTiming,
                          StreamBatch, TokenDelta, WorkerStats)
from kvtransfer.handle import KVBlocksHandle
from router.step_model import StepTimeModel

# SmolLM2-135M's KV layout: what a hand-off would move (bytes per block in PrefillResult).
SIM_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
NUM_RECENT_STEPS = 64   # as EngineConfig.num_recent_steps
SIM_VOCAB = 49152


def prompt_seed(spec: RequestSpec) -> int:
    """What a request's simulated tokens follow from: its original prompt (a migrated request's
    prompt carries its output so far, which is left out)."""
    prompt = spec.prompt_token_ids[:len(spec.prompt_token_ids) - spec.num_generated]
    return zlib.crc32(repr(prompt).encode())


def sim_token(seed: int, position: int) -> int:
    """The token a simulated worker emits at output ``position`` of the request with ``seed``."""
    return 3 + (seed + 7919 * position) % (SIM_VOCAB - 3)


@dataclass(frozen=True, slots=True)
class SimSpeed:
    """How long a simulated step takes: the router's own step-time model, fitted to real steps."""

    model: StepTimeModel
    prefill_s_per_token: float

    @classmethod
    def fitted(cls, steps: Sequence[StepTiming]) -> SimSpeed:
        model = StepTimeModel(max_steps=max(1, len(steps)))
        model.observe(tuple(steps))
        spt = model.seconds_per_prefill_token()
        if model.predict(1, 0) is None or spt is None:
            raise ValueError("the step timings hold too few decode or prefill steps to fit")
        return cls(model, spt)

    def step_s(self, num_decode_seqs: int, num_kv_tokens: int, num_prefill_tokens: int = 0) -> float:
        decode = self.model.predict(num_decode_seqs, num_kv_tokens) if num_decode_seqs else 0.0
        return decode + num_prefill_tokens * self.prefill_s_per_token


@dataclass(slots=True)
class SimConfig:
    block_size: int = SIM_LAYOUT.block_size
    num_blocks: int = 4096
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class _Blocks:
    """A worker's KV pool, as counts: the simulator owns no memory."""

    def __init__(self, total: int, block_size: int) -> None:
        self.total, self.free, self.block_size = total, total, block_size
        self.held: dict[str, int] = {}

    def take(self, req_id: str, num_tokens: int) -> None:
        need = _blocks(num_tokens, self.block_size) - self.held.get(req_id, 0)
        if need > self.free:
            raise CapacityError(f"{need} KV blocks needed, {self.free} free")
        self.free -= need
        self.held[req_id] = self.held.get(req_id, 0) + need

    def grow(self, req_id: str, num_tokens: int) -> None:
        """A decoding request's next block, when there is one (preemption is not simulated)."""
        if _blocks(num_tokens, self.block_size) > self.held.get(req_id, 0) and self.free:
            self.free -= 1
            self.held[req_id] += 1

    def release(self, req_id: str) -> None:
        self.free += self.held.pop(req_id, 0)


class _SimWorker:
    role = ""

    def __init__(self, worker_id: str, speed: SimSpeed, config: SimConfig | None = None) -> None:
        self.worker_id = worker_id
        self.speed = speed
        self.config = config or SimConfig()
        self.blocks = _Blocks(self.config.num_blocks, self.config.block_size)
        self.recent_steps: deque[StepTiming] = deque(maxlen=NUM_RECENT_STEPS)
        self.num_steps = 0
        self._wake: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> dict:
        """In the loop the worker runs on; returns what the real actor's ``start`` returns."""
        self._wake, self._closed = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.worker_id}")
        return {"worker_id": self.worker_id, "node_id": "sim-node", "device": "cpu", "max_model_len": 8192,
                "vocab_size": SIM_VOCAB, "block_size": self.config.block_size, "model": "simulated",
                "prefix_caching": False, "shm_path": None, "pid": None, "startup_s": {}}

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step()

    def _has_work(self) -> bool:
        raise NotImplementedError

    async def _step(self) -> None:
        raise NotImplementedError

    async def _timed_step(self, num_seqs: int, num_decode: int, num_kv: int, num_prefill: int) -> None:
        duration = self.speed.step_s(num_decode, num_kv, num_prefill)
        await asyncio.sleep(duration)
        self.num_steps += 1
        self.recent_steps.append(StepTiming(num_seqs, num_decode + num_prefill, num_prefill, num_kv, duration))

    def _stats(self, num_waiting: int, num_running: int, num_waiting_tokens: int) -> WorkerStats:
        return WorkerStats(self.worker_id, self.role, num_waiting, num_running, num_waiting_tokens,
                           self.blocks.free, self.blocks.total, self.config.block_size,
                           recent_steps=tuple(self.recent_steps))

    def leak_report(self) -> dict:
        return {"requests": self._num_requests(), "free_blocks": self.blocks.free, "total_blocks": self.blocks.total}

    def _num_requests(self) -> int:
        raise NotImplementedError

    async def lifeline(self) -> None:
        await self._closed.wait()

    async def heartbeat(self) -> float:
        """The router's stall watch asks as it asks a real worker; a simulated step never hangs."""
        return 0.0

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._closed is not None:
            self._closed.set()


# ---------------------------------------------------------------- decode


@dataclass(slots=True, eq=False)
class _Seq:
    spec: RequestSpec
    num_output: int = 0                 # tokens emitted so far (the first one included)
    prompt_left: int = 0                # prompt tokens still to prefill here (add_request)
    seed: int = 0                       # prompt_seed(spec)

    @property
    def num_kv(self) -> int:
        return len(self.spec.prompt_token_ids) - self.prompt_left + self.num_output


class SimDecodeWorker(_SimWorker):
    role = "decode"

    def __init__(self, worker_id: str, speed: SimSpeed, config: SimConfig | None = None,
                 colocated: bool = False) -> None:
        super().__init__(worker_id, speed, config)
        self.role = "colocated" if colocated else "decode"
        self._parked: dict[str, RequestSpec] = {}
        self._waiting: dict[str, _Seq] = {}    # committed or added, not yet in the running batch
        self._running: dict[str, _Seq] = {}
        self._batches: deque[StreamBatch] = deque()
        self._published: asyncio.Event | None = None

    def start(self) -> dict:
        self._published = asyncio.Event()
        return super().start()

    # ---- the actor's request methods ----------------------------------------------------------
    async def reserve(self, spec: RequestSpec, transport: str) -> KVBlocksHandle:
        if spec.req_id not in self._parked:    # a retried call: the reservation it made stands
            self.blocks.take(spec.req_id, len(spec.prompt_token_ids))
            self._parked[spec.req_id] = spec
        n = len(spec.prompt_token_ids)
        return KVBlocksHandle(spec.req_id, (), tuple(range(_blocks(n, self.config.block_size))), n, SIM_LAYOUT,
                              transport, lease_deadline_s=time.time() + 120.0)

    async def commit(self, req_id: str, first_token_id: int, handle: KVBlocksHandle) -> float:
        spec = self._parked.pop(req_id, None)
        if spec is None:
            raise KVTransferError(f"{req_id}: no live reservation here (aborted, or its lease ran out)")
        seq = _Seq(spec, num_output=1, seed=prompt_seed(spec))
        if seq.num_output >= spec.sampling.max_tokens:   # ended with its first token
            self.blocks.release(req_id)
            self._publish((TokenDelta(req_id, (), FinishReason.LENGTH),))
        else:
            self._waiting[req_id] = seq
            self._wake.set()
        return 0.0

    async def add_request(self, spec: RequestSpec) -> None:
        if spec.req_id in self._waiting or spec.req_id in self._running:
            return
        if spec.req_id in self._parked:
            raise InvalidRequestError("request_id", f"{spec.req_id!r} is already in flight")
        self.blocks.take(spec.req_id, len(spec.prompt_token_ids))
        self._waiting[spec.req_id] = _Seq(spec, prompt_left=len(spec.prompt_token_ids), seed=prompt_seed(spec))
        self._wake.set()

    async def abort(self, req_id: str, writer_gone: bool = True) -> None:
        """Freed at once: no simulated writer can still be busy with the blocks."""
        for table in (self._parked, self._waiting, self._running):
            table.pop(req_id, None)
        self.blocks.release(req_id)

    async def stream(self) -> AsyncIterator[StreamBatch]:
        """One consumer; batches that queued up meanwhile are merged, as the real worker does."""
        while True:
            while not self._batches:
                self._published.clear()
                await self._published.wait()
            yield self.take_batches()

    def take_batches(self) -> StreamBatch:
        batch = self._batches.popleft()
        if not self._batches:
            return batch
        deltas = list(batch.deltas)
        while self._batches:
            batch = self._batches.popleft()
            deltas.extend(batch.deltas)
        return StreamBatch(self.worker_id, tuple(deltas), batch.stats)

    def stats(self) -> WorkerStats:
        waiting_tokens = sum(s.prompt_left for s in self._waiting.values())
        return self._stats(len(self._waiting) + len(self._parked), len(self._running), waiting_tokens)

    def _num_requests(self) -> int:
        return len(self._parked) + len(self._waiting) + len(self._running)

    # ---- the step loop ------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._running or self._waiting)

    async def _step(self) -> None:
        for req_id in list(self._waiting):       # join the batch at the step boundary
            if len(self._running) >= self.config.max_num_seqs:
                break
            self._running[req_id] = self._waiting.pop(req_id)
        batch = list(self._running.values())
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, int] = {}
        for seq in batch:                         # local prefill (colocated, conditional, recompute)
            if seq.prompt_left and budget > 0:
                chunks[seq.spec.req_id] = min(seq.prompt_left, budget)
                budget -= chunks[seq.spec.req_id]
        decoding = [s for s in batch if not s.prompt_left]
        num_kv = sum(s.num_kv for s in batch)
        await self._timed_step(len(chunks) + len(decoding), len(decoding), num_kv, sum(chunks.values()))
        deltas = []
        for seq in batch:
            req_id = seq.spec.req_id
            if req_id not in self._running:      # aborted during the step
                continue
            if seq.prompt_left:
                seq.prompt_left -= chunks.get(req_id, 0)
                if seq.prompt_left:
                    continue
            deltas.append(self._advance(seq))
        self._publish(tuple(deltas))

    def _advance(self, seq: _Seq) -> TokenDelta:
        req_id = seq.spec.req_id
        token = sim_token(seq.seed, seq.spec.num_generated + seq.num_output)
        seq.num_output += 1
        self.blocks.grow(req_id, seq.num_kv)
        if seq.num_output >= seq.spec.sampling.max_tokens:
            del self._running[req_id]
            self.blocks.release(req_id)
            return TokenDelta(req_id, (token,), FinishReason.LENGTH)
        return TokenDelta(req_id, (token,))

    def _publish(self, deltas: tuple[TokenDelta, ...]) -> None:
        self._batches.append(StreamBatch(self.worker_id, deltas, self.stats()))
        self._published.set()


# ---------------------------------------------------------------- prefill


@dataclass(slots=True, eq=False)
class _Prompt:
    spec: RequestSpec
    left: int
    added_s: float = field(default_factory=time.perf_counter)
    scheduled_s: float | None = None
    done: asyncio.Future | None = None


class SimPrefillWorker(_SimWorker):
    role = "prefill"

    def __init__(self, worker_id: str, speed: SimSpeed, config: SimConfig | None = None) -> None:
        super().__init__(worker_id, speed, config)
        self._queue: dict[str, _Prompt] = {}       # every request here, arrival order
        self._pending: dict[str, _Prompt] = {}     # those with prompt tokens left to prefill
        self._handoffs: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()

    async def prefill(self, spec: RequestSpec, transport: str, decode: Any, inbox: str | None = None) -> PrefillResult:
        """``decode``: the decode worker's actor handle: this worker calls its ``reserve`` (over
        ``transport``) as the prompt is queued and its ``commit`` once the KV is ready.
        ``inbox`` (the router's first-token inbox) is not simulated: no first token goes ahead."""
        task = self._handoffs.get(spec.req_id)
        if task is None:
            task = self._handoffs[spec.req_id] = asyncio.ensure_future(self._prefill(spec, transport, decode))
            task.add_done_callback(lambda _: self._handoffs.pop(spec.req_id, None))
        return await asyncio.shield(task)

    async def _prefill(self, spec: RequestSpec, transport: str, decode: Any) -> PrefillResult:
        prompt = _Prompt(spec, len(spec.prompt_token_ids), done=asyncio.get_running_loop().create_future())
        self.blocks.take(spec.req_id, prompt.left)
        self._queue[spec.req_id] = self._pending[spec.req_id] = prompt
        self._wake.set()
        handle = asyncio.ensure_future(_awaited(decode.reserve.remote(spec, transport)))
        handle.add_done_callback(lambda t: t.cancelled() or t.exception())   # read by the hand-off, or nobody
        try:
            await prompt.done
            first = sim_token(prompt_seed(spec), spec.num_generated)
            scheduled_s = prompt.scheduled_s or time.perf_counter()
            queue_s, prefill_s = scheduled_s - prompt.added_s, time.perf_counter() - scheduled_s
            if spec.req_id in self._aborted:
                return self._result(spec, first, queue_s, prefill_s, FinishReason.ABORT, HandoffOutcome.ABORTED)
            if spec.sampling.max_tokens <= 1:
                return self._result(spec, first, queue_s, prefill_s, FinishReason.LENGTH,
                                    HandoffOutcome.ENDED_AT_PREFILL)
            return await self._hand_off(spec, first, queue_s, prefill_s, handle, decode)
        finally:
            await asyncio.wait([handle])   # the router frees an unused reservation: after it landed
            self._queue.pop(spec.req_id, None)
            self._pending.pop(spec.req_id, None)
            self._aborted.discard(spec.req_id)
            self.blocks.release(spec.req_id)

    async def _hand_off(self, spec: RequestSpec, first: int, queue_s: float, prefill_s: float, handle: Any,
                        decode: Any) -> PrefillResult:
        start = time.perf_counter()
        try:
            reserved: KVBlocksHandle = await handle
        except Exception as exc:
            refused = isinstance(exc, CapacityError)   # no room: the router queues or refuses
            outcome = HandoffOutcome.RESERVE_REFUSED if refused else HandoffOutcome.RESERVE_FAILED
            return self._result(spec, first, queue_s, prefill_s, FinishReason.ERROR, outcome, error=str(exc))
        try:
            await decode.commit.remote(spec.req_id, first, reserved)
        except KVTransferError as exc:
            return self._result(spec, first, queue_s, prefill_s, FinishReason.ERROR,
                                HandoffOutcome.TRANSFER_FAILED, error=f"KV transfer failed: {exc}")
        result = self._result(spec, first, queue_s, prefill_s, None, HandoffOutcome.OK)
        return dataclasses.replace(result, transfer_s=time.perf_counter() - start, transfer_bytes=reserved.num_bytes,
                                   transport=reserved.transport)

    def _result(self, spec: RequestSpec, first: int, queue_s: float, prefill_s: float,
                reason: FinishReason | None, outcome: HandoffOutcome, error: str | None = None) -> PrefillResult:
        return PrefillResult(spec.req_id, first, reason, None, error, queue_s, prefill_s, outcome=outcome,
                             stats=self.stats())

    async def abort(self, req_id: str) -> None:
        """Returns once nothing of the request runs here (its hand-off, if started, is over)."""
        task = self._handoffs.get(req_id)
        if task is None:
            return
        self._aborted.add(req_id)
        prompt = self._pending.pop(req_id, None)
        if prompt is not None:
            prompt.done.set_result(None)
        await asyncio.wait([task])

    def stats(self) -> WorkerStats:
        return self._stats(len(self._pending), 0, sum(p.left for p in self._pending.values()))

    def _num_requests(self) -> int:
        return len(self._queue)

    def _has_work(self) -> bool:
        return bool(self._pending)

    async def _step(self) -> None:
        budget, chunks = self.config.max_num_batched_tokens, []
        now = time.perf_counter()
        for prompt in self._pending.values():    # chunked prefill, first come first served
            if budget <= 0:
                break
            chunks.append((prompt, min(prompt.left, budget)))
            budget -= chunks[-1][1]
            prompt.scheduled_s = prompt.scheduled_s or now
        num_tokens = sum(n for _, n in chunks)
        await self._timed_step(len(chunks), 0, sum(len(p.spec.prompt_token_ids) - p.left + n for p, n in chunks),
                               num_tokens)
        for prompt, n in chunks:
            if self._pending.get(prompt.spec.req_id) is not prompt:   # aborted during the step
                continue
            prompt.left -= n
            if not prompt.left:
                del self._pending[prompt.spec.req_id]
                prompt.done.set_result(None)


async def _awaited(ref: Any) -> Any:
    return await ref
