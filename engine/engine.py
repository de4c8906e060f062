"""The in-process engine both workers wrap: add requests, step, abort, stats.

Life cycle of a request inside one engine:
  add_request (validated) -> waiting -> scheduled step by step (chunked prefill, decode)
  -> finished (EOS / stop / length) | aborted | failed; blocks freed at that step boundary.
Roles (EngineConfig.role):
  colocated: prefill and decode mixed in one packed batch.
  prefill:   after the first token the request is *held*: its blocks stay allocated until the
             worker has exported the KV and calls ``release``.
  decode:    ``reserve`` parks a request with blocks for its prompt (the leading ones may
             already hold a cached prefix: only the rest must arrive); once the KV has landed,
             ``commit_kv`` lets it join the running batch with the first token.
Prefix caching (``EngineConfig.enable_prefix_caching``, on by default) is the KV manager's and
the scheduler's business: a request's prefill starts after its longest cached prefix.
Each ``step`` returns the TokenDeltas it produced (one per request with news) and, in the
prefill role, the requests whose KV is ready for hand-off.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine import cuda_graphs, freed_memory, kv_cache, model_support, prompt_logprobs
from engine.config import EngineConfig, EngineRole
from engine.dtypes import torch_dtype
from engine.errors import CapacityError, InvalidRequestError
from engine.kv_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.prefix_hash import HashFn, default_block_hash
from engine.request import Request
from engine.grammar import Grammars
from engine.sampler import RowFailure, sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stop import StopChecker
from engine.types import (FinishReason, KVEvent, KVLayout, PromptLogprobs, RequestSpec, StepTiming, TokenDelta,
                          TopLogprobs, WorkerStats)
from engine.validation import validate_spec

if TYPE_CHECKING:
    from engine.model_loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill role: a request whose prompt KV is complete and held for export."""

    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int            # prompt tokens whose KV is in the blocks
    first_token_id: int
    first_logprob: float | None
    first_top_logprobs: TopLogprobs | None
    prompt_logprobs: PromptLogprobs | None   # with sampling.prompt_logprobs
    queue_s: float             # added -> first scheduled
    prefill_s: float           # first scheduled -> first token
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)


@dataclass(slots=True)
class StepResult:
    deltas: list[TokenDelta] = field(default_factory=list)
    prefilled: list[PrefillDone] = field(default_factory=list)
    timing: StepTiming | None = None
    between_steps: bool = False   # no step ran: calls changed the engine (EngineLoop); publish stats
    # Nothing could be scheduled though requests wait (their grammars compile; blocks held by
    # parked requests): the loop waits for a call or a compile instead of stepping again at once.
    stalled: bool = False
    # Prefix-cache changes since the last result (this step's and any calls' before it), for the
    # router's prefix index: every result takes them, so each goes out once.
    kv_events: tuple[KVEvent, ...] = ()


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, cache: torch.Tensor | None = None,
                 block_hash_fn: HashFn = default_block_hash):
        """``block_hash_fn``: the prefix cache's block hash (tests inject colliding ones)."""
        self.config = config = config or EngineConfig()
        if config.device == "auto":
            raise ValueError("the engine needs a decided device ('cpu', 'cuda'); the launcher resolves 'auto'")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            freed_memory.keep()   # every step's activations would page-fault in anew otherwise
        self.loaded = loaded
        self.vocab_size = loaded.model.config.vocab_size
        model_support.check_config(loaded.model.config)
        self.layout: KVLayout = kv_cache.layout_for(loaded.model.config, config)
        if cache is None:
            cache = kv_cache.allocate(self.layout, kv_cache.num_blocks_for(self.layout, config), config.device)
        self.cache = cache
        _check_dtype(loaded.model, self.layout.dtype)
        num_blocks = cache.shape[2] - cuda_graphs.reserved_blocks(config, cache.shape[2])
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, block_hash_fn)
        self.pool_tokens = num_blocks * config.block_size
        # A request must fit the pool on its own: preempting the others could never make room
        # for a larger one, which would be preempted and rescheduled forever. So, as vLLM caps
        # max_model_len to what its KV cache holds, a worker serves at most the pool's tokens;
        # a prefill worker holds prompts only: it checks those (in _validate).
        self.max_model_len = loaded.max_model_len if config.role is EngineRole.PREFILL else min(
            loaded.max_model_len, self.pool_tokens)
        stop = StopChecker(loaded.eos_token_ids, loaded.max_model_len, loaded.tokenizer)
        self.scheduler = Scheduler(config, self.kv, stop)
        self.runner = ModelRunner(loaded.model, cache, config.block_size, config.decode_attention_group,
                                  cuda_graphs.plan_for(config, cache.shape[2], self.max_model_len))
        model_support.probe(self.runner, self.layout)
        self._seeds: dict[str, int] = {}
        self.eos_token_ids = frozenset(loaded.eos_token_ids)   # what min_tokens holds back
        self.grammars = Grammars(loaded.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self._last_num_kv_tokens = 0
        self.recent_steps: deque[StepTiming] = deque(maxlen=config.num_recent_steps)
        graphs = self.runner.graphs
        logger.info("engine ready: role=%s, %d KV blocks of %d tokens, %s", config.role.value, num_blocks,
                    config.block_size, f"{graphs.num_graphs} decode graphs captured in {graphs.capture_s:.1f} s"
                    if graphs is not None else "decode steps eager")

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        """Validate and queue; raises InvalidRequestError and leaves the engine untouched."""
        self._validate(spec)
        self.scheduler.add(self._new_request(spec))

    def reserve(self, spec: RequestSpec) -> list[int]:
        """Decode role: park the request with blocks reserved for its prompt's KV."""
        return self.reserve_prefix(spec)[0]

    def reserve_prefix(self, spec: RequestSpec) -> tuple[list[int], int]:
        """``reserve``, also returning how many leading prompt tokens' KV this engine holds
        already (a cached prefix, whole blocks): the hand-off moves only the rest."""
        self._validate(spec)
        request = self._new_request(spec)   # before the lookup: it may refuse, holding nothing
        prompt = spec.prompt_token_ids
        cached = self.kv.find_cached(spec.req_id, prompt)
        if not self.kv.can_admit(spec.req_id, cached, len(prompt)):
            needed = -(-len(prompt) // self.config.block_size) - len(cached)
            self.kv.free(spec.req_id)   # forget the lookup's state
            self._seeds.pop(spec.req_id, None)
            raise CapacityError(f"{needed} KV blocks needed, {self.kv.num_free_blocks} free")
        blocks = self.scheduler.park(request, cached)
        return blocks, len(cached) * self.config.block_size

    def commit_kv(self, req_id: str, first_token_id: int) -> TokenDelta | None:
        """Decode role: the reserved blocks now hold the prompt's KV; start decoding."""
        request = self.scheduler.unpark(req_id, first_token_id)
        return self._delta(request) if request.is_finished else None

    def abort(self, req_id: str) -> None:
        """Takes effect at the next step boundary (a parked or held request is freed at once)."""
        if self.scheduler.abort(req_id):
            self._seeds.pop(req_id, None)

    def release(self, req_id: str) -> None:
        """Prefill role: the held KV has been exported (or the hand-off failed); free its blocks."""
        self.scheduler.release_held(req_id)
        self._seeds.pop(req_id, None)

    # ---- the step loop -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> StepResult:
        result = self._step()
        result.kv_events = self.take_kv_events()
        return result

    def take_kv_events(self) -> tuple[KVEvent, ...]:
        """The prefix cache's changes since the last call (``StepResult.kv_events``)."""
        return self.kv.pool.take_events()

    def _step(self) -> StepResult:
        start = time.perf_counter()
        out, aborted = self.scheduler.schedule()
        result = StepResult(deltas=[self._delta(r) for r in aborted])
        if out.is_empty:
            result.stalled = not aborted and not out.preempted_req_ids
            return result
        try:
            sampled = self._run(out, result)
            batched = True
        except Exception as exc:  # a failed forward fails its request(s), never the engine
            if len(out.scheduled) == 1:
                logger.exception("step failed; failing %s", out.scheduled[0].request.req_id)
                result.deltas.append(self._fail_request(out.scheduled[0].request, _describe(exc)))
                return result
            logger.exception("step of %d requests failed; retrying them one by one", len(out.scheduled))
            sampled, batched = self._run_one_by_one(out, result), False
        live = SchedulerOutput([s for s in out.scheduled if not s.request.is_finished], out.num_batched_tokens)
        finished = self.scheduler.update_from_output(live, sampled)
        self._collect(live, finished, result)
        if batched:  # a retried step's time says nothing about this batch shape
            result.timing = self._record_timing(out, time.perf_counter() - start)
        return result

    def _run(self, out: SchedulerOutput, result: StepResult) -> dict[str, tuple]:
        """Forward and sample ``out``; a row that cannot be sampled fails its request alone.
        Nothing here changes a request's progress, so a failed call can be retried."""
        inputs = self.runner.prepare(out)
        logits = self.runner.execute(inputs)
        self._last_num_kv_tokens = inputs.num_kv_tokens
        sampling = [s.request for s in out.scheduled if s.sample]
        if logits.shape[0] > len(sampling):   # the rows after the sampling ones: prompt logprobs
            prompt_logprobs.record([(s.request, s.prompt_positions) for s in out.scheduled if s.prompt_positions],
                                   logits[len(sampling):])
            logits = logits[: len(sampling)]
        sampled = {}
        outcomes = sample(logits, sampling, self._seeds, self.eos_token_ids) if sampling else []
        for request, outcome in zip(sampling, outcomes):
            if isinstance(outcome, RowFailure):
                result.deltas.append(self._fail_request(request, outcome.message, outcome.field))
            else:
                sampled[request.req_id] = outcome
        return sampled

    def _run_one_by_one(self, out: SchedulerOutput, result: StepResult) -> dict[str, tuple]:
        """Each request alone, so only the one whose forward fails is failed. Re-running the
        forward rewrites the same KV slots with the same values: progress only advances in
        ``update_from_output``, after this."""
        sampled: dict[str, tuple] = {}
        for s in out.scheduled:
            try:
                sampled.update(self._run(SchedulerOutput([s], s.num_new_tokens), result))
            except Exception as exc:
                logger.exception("request %s failed its forward", s.request.req_id)
                result.deltas.append(self._fail_request(s.request, _describe(exc)))
        return sampled

    def _collect(self, out: SchedulerOutput, finished: list[Request], result: StepResult) -> None:
        for s in out.scheduled:
            r = s.request
            if len(r.output_token_ids) > r.num_reported_tokens:
                result.deltas.append(self._delta(r))
        for r in finished:
            if self.scheduler.is_held(r.req_id):
                blocks = tuple(self.kv.block_tables[r.req_id])
                result.prefilled.append(self._prefill_done(r, blocks))
            else:
                self._seeds.pop(r.req_id, None)

    @staticmethod
    def _prefill_done(r: Request, blocks: tuple[int, ...]) -> PrefillDone:
        queue_s, prefill_s = _phases(r)
        return PrefillDone(
            req_id=r.req_id,
            block_ids=blocks,
            num_tokens=r.num_prompt_tokens,
            first_token_id=r.output_token_ids[0],
            first_logprob=r.output_logprobs[0] if r.output_logprobs else None,
            first_top_logprobs=r.output_top_logprobs[0] if r.output_top_logprobs else None,
            prompt_logprobs=prompt_logprobs.result(r),
            queue_s=queue_s,
            prefill_s=prefill_s,
            num_cached_tokens=r.num_cached_tokens,
        )

    def _fail_request(self, request: Request, message: str, field: str | None = None) -> TokenDelta:
        """Finish one request with ERROR (its blocks freed now); the delta carries ``message`` (and
        ``field``: the sampling field to blame, where the request's constraints caused it)."""
        self.scheduler.finish(request, FinishReason.ERROR)
        self._seeds.pop(request.req_id, None)
        return self._delta(request, error=message, error_field=field)

    def _delta(self, request: Request, error: str | None = None, error_field: str | None = None) -> TokenDelta:
        first = request.num_reported_tokens == 0 and bool(request.output_token_ids)
        new = tuple(request.output_token_ids[request.num_reported_tokens :])
        done = request.num_reported_tokens
        logprobs = tuple(request.output_logprobs[done:]) if request.sampling.logprobs else None
        tops = tuple(request.output_top_logprobs[done:]) if request.output_top_logprobs else None
        request.num_reported_tokens = len(request.output_token_ids)
        reason = request.finish_reason if request.is_finished else None
        phases = _phases(request) if first and reason is not None and self.config.role is EngineRole.PREFILL else None
        return TokenDelta(request.req_id, new, reason, logprobs, error, request.num_cached_tokens if first else 0, tops,
                          prompt_logprobs.result(request) if first else None, error_field, phases)

    def _record_timing(self, out: SchedulerOutput, duration_s: float) -> StepTiming:
        timing = StepTiming(
            num_seqs=len(out.scheduled),
            num_tokens=out.num_batched_tokens,
            num_prefill_tokens=sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1),
            num_kv_tokens=self._last_num_kv_tokens,
            duration_s=duration_s,
        )
        self.recent_steps.append(timing)
        return timing

    # ---- helpers -------------------------------------------------------------------------------
    def _validate(self, spec: RequestSpec) -> None:
        validate_spec(spec, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      eos_token_ids=self.eos_token_ids)
        if self.config.role is EngineRole.PREFILL and len(spec.prompt_token_ids) > self.pool_tokens:
            raise InvalidRequestError("prompt", f"has {len(spec.prompt_token_ids)} tokens; this worker's KV pool "
                                                f"holds {self.pool_tokens}")
        if self.scheduler.knows(spec.req_id):
            raise InvalidRequestError("request_id", f"{spec.req_id!r} is already in flight")

    def _new_request(self, spec: RequestSpec) -> Request:
        request = Request(spec)
        if spec.sampling.structured_output is not None:   # before anything is held: it may refuse
            request.grammar = self.grammars.matcher(spec.sampling.structured_output)
        self._seeds[spec.req_id] = spec.sampling.seed if spec.sampling.seed is not None else random.getrandbits(62)
        return request

    def stats(self, worker_id: str = "engine") -> WorkerStats:
        s = self.scheduler
        return WorkerStats(
            worker_id=worker_id,
            role=self.config.role.value,
            num_waiting=len(s.waiting) + len(s.parked),
            num_running=len(s.running),
            num_waiting_tokens=s.num_waiting_tokens,
            num_free_blocks=self.kv.num_free_blocks,
            num_parked_blocks=s.num_parked_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            block_size=self.config.block_size,
            num_preemptions=s.num_preemptions,
            prefix_cache_query_tokens=self.kv.counters.queries,
            prefix_cache_hit_tokens=self.kv.counters.hits,
            recent_steps=tuple(self.recent_steps),
        )

    def generate(self, specs: list[RequestSpec]) -> dict[str, list[int]]:
        """Run the given requests to completion (tests, benchmarks, the demo)."""
        for spec in specs:
            self.add_request(spec)
        outputs: dict[str, list[int]] = {spec.req_id: [] for spec in specs}
        while self.has_work():
            for delta in self.step().deltas:
                outputs.setdefault(delta.req_id, []).extend(delta.token_ids)
        return outputs


def _check_dtype(model: torch.nn.Module, kv_dtype: str) -> None:
    """The KV cache holds what the model's projections produce: one dtype for both."""
    model_dtype = next(model.parameters()).dtype
    if model_dtype != torch_dtype(kv_dtype):
        raise ValueError(f"the model's weights are {model_dtype} but the engine's dtype is {kv_dtype}: "
                         "load the model in the engine's dtype")


def _describe(exc: BaseException) -> str:
    """What a failed request's delta carries: the router logs it (clients get a reference)."""
    return f"{type(exc).__name__}: {exc}"


def _phases(r: Request) -> tuple[float, float]:
    """A prefilled request's queue (added -> first scheduled) and compute (-> now) seconds."""
    scheduled = r.first_scheduled_s or r.added_s
    return scheduled - r.added_s, time.perf_counter() - scheduled
