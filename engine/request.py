"""Worker-local state of one request, from arrival to finish.

Life cycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption (recompute)
and, in a decode worker, WAITING_FOR_KV -> RUNNING once the prefill worker's KV has landed.
Prefill, chunked prefill and decode are one mechanism (vLLM v1): ``num_computed_tokens``
catches up with the known tokens (prompt + output) a chunk at a time.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.grammar import GrammarMatcher
from engine.types import FinishReason, RequestSpec, SamplingParams, TopLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    spec: RequestSpec
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)   # with sampling.top_logprobs
    # With sampling.prompt_logprobs, while this engine owes them (engine/prompt_logprobs.py):
    # prompt_logprobs[p] is prompt token p + 1's; None: not asked, or another worker computes them.
    prompt_logprobs: list[float] | None = field(init=False)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Tokens not yet reported in a TokenDelta (a preempted request re-reports nothing).
    num_reported_tokens: int = 0
    # Worker-local perf_counter stamps for per-request timings.
    added_s: float = field(default_factory=time.perf_counter)
    first_scheduled_s: float | None = None
    num_cached_tokens: int = 0      # prompt tokens found in the prefix cache when first scheduled
    all_token_ids: list[int] = field(init=False)
    # The spec's, copied once: read several times per request every step, so plain attributes
    # rather than properties (the spec is frozen and never replaced).
    req_id: str = field(init=False)
    sampling: SamplingParams = field(init=False)
    adjusts_logits: bool = field(init=False)   # the sampler's per-row check, every step
    # With sampling.structured_output: its matcher (engine/grammar.py), attached by the engine on
    # add; a cache of the output tokens, so preemption and migration need nothing of it.
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.spec.prompt_token_ids)
        self.req_id = self.spec.req_id
        self.sampling = self.spec.sampling
        self.adjusts_logits = self.sampling.adjusts_logits
        # A migrated request (tokens already streamed) had them from its first worker.
        self.prompt_logprobs = [] if self.spec.owes_prompt_logprobs else None

    def forgo_prompt_logprobs(self) -> None:
        """Its prompt's KV comes from a prefill worker, which delivers them with the first token."""
        self.prompt_logprobs = None

    def add_prompt_logprob(self, position: int, logprob: float, rank: int, top: TopLogprobs | None) -> None:
        """Position ``position``'s entry (prompt token position + 1's), once: a retried step or a
        chunk recomputed after preemption adds nothing twice."""
        if position != len(self.prompt_logprobs):
            return
        self.prompt_logprobs.append(logprob)
        self.prompt_ranks.append(rank)
        if top is not None:
            self.prompt_top_logprobs.append(top)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_generated(self) -> int:
        """Output tokens so far, counting those a migrated request streamed before it moved."""
        return self.spec.num_generated + len(self.output_token_ids)

    def generated_tail(self, n: int) -> list[int]:
        """The last ``n`` output tokens, reaching back into the prompt of a migrated request."""
        start = max(len(self.all_token_ids) - n, self.num_prompt_tokens - self.spec.num_generated)
        return self.all_token_ids[start:]

    def append_output(self, token_id: int, logprob: float | None, top: TopLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def sort_key(self) -> tuple[int, float]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.spec.priority, self.spec.arrival_s)
