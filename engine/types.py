"""Typed, torch-free records that flow between router, workers and engine.

Frozen dataclasses cross process boundaries (Ray pickles them); the router imports this
module without pulling in torch.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the model's maximum length
    ABORT = "abort"          # cancelled by the client, a deadline or shutdown
    ERROR = "error"          # a worker or transfer failure


# Below this temperature sampling is greedy (vLLM's rule): logits / temperature would overflow
# float32 (and a distribution that sharp is argmax anyway).
GREEDY_TEMPERATURE = 1e-5


MAX_TOP_LOGPROBS = 20   # OpenAI's bound on top_logprobs


class GuideKind(str, enum.Enum):
    """What a structured output's ``spec`` is (vLLM's ``structured_outputs`` keys)."""

    JSON = "json"                 # a JSON schema, as JSON text
    JSON_OBJECT = "json_object"   # any JSON object (OpenAI's response_format json_object); spec ""
    REGEX = "regex"               # the whole output matches this regular expression
    CHOICE = "choice"             # the output is one of these strings (spec: a JSON list of them)
    GRAMMAR = "grammar"           # a context-free grammar in Lark or GBNF syntax (llguidance's)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the whole output (engine/grammar.py turns it into llguidance's grammar):
    every token chosen keeps the output a prefix of a match; EOS only where it is a whole one."""

    kind: GuideKind
    spec: str = ""
TopLogprobs = tuple[tuple[int, float], ...]   # one position's (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. Defaults are semantic: temperature 0 (below ``GREEDY_TEMPERATURE``) means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0              # 0 disables top-k
    min_p: float = 0.0          # [0, 1]: tokens less likely than min_p x the likeliest are not sampled (0: off)
    min_tokens: int = 0         # EOS and stop_token_ids cannot be chosen before this many output tokens
    seed: int | None = None     # same seed, same output, whatever shares the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False   # the router keeps a stop string in the text (what follows goes)
    skip_special_tokens: bool = True   # the output text leaves special tokens out: where stop strings are matched
    logprobs: bool = False
    top_logprobs: int = 0       # with logprobs: also the N most likely tokens at each position (<= MAX_TOP_LOGPROBS)
    # None: off; N in [0, MAX_TOP_LOGPROBS]: each prompt token's logprob and its N most likely (engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    # Logit adjustments before sampling, greedy included (engine/logit_adjust.py); the defaults are off.
    repetition_penalty: float = 1.0    # > 0: prompt and output tokens' logits divided (> 0) / multiplied (< 0) by it
    frequency_penalty: float = 0.0     # [-2, 2]: times the token's count in the output, subtracted
    presence_penalty: float = 0.0      # [-2, 2]: subtracted once from every token in the output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) added to its logit
    allowed_token_ids: tuple[int, ...] = ()          # non-empty: only these can be chosen (vLLM's)
    # vLLM's bad words as token ids: a one-token word is never chosen; a longer one's last token is
    # not chosen where the output ends with the word's other tokens (the router tokenizes them).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_output: StructuredOutput | None = None   # None: free text

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or bool(self.allowed_token_ids) or bool(self.bad_words_token_ids)
                or self.structured_output is not None)

    @classmethod
    def from_plain(cls, fields: dict) -> SamplingParams:
        """From ``dataclasses.asdict``'s output after a JSON round trip (lists back to tuples)."""
        return cls(**{**fields, "stop": tuple(fields["stop"]), "stop_token_ids": tuple(fields["stop_token_ids"]),
                      "logit_bias": tuple((int(t), float(b)) for t, b in fields["logit_bias"]),
                      "allowed_token_ids": tuple(fields["allowed_token_ids"]),
                      "bad_words_token_ids": tuple(tuple(w) for w in fields["bad_words_token_ids"]),
                      "structured_output": fields["structured_output"] and StructuredOutput(
                          GuideKind(fields["structured_output"]["kind"]), fields["structured_output"]["spec"])})


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prompt's logprobs. ``token_ids``: the prompt; the others hold one entry per prompt token
    after the first (which has no context), entry i for ``token_ids[i + 1]``: ``logprobs[i]`` its
    logprob given the tokens before it, ``ranks[i]`` its rank there (1: the most likely; vLLM's),
    and with ``sampling.prompt_logprobs`` = N > 0, ``top[i]`` that position's N most likely tokens
    (else ``top`` is empty)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[TopLogprobs, ...] = ()

    @classmethod
    def from_plain(cls, fields: dict) -> PromptLogprobs:
        """From ``dataclasses.asdict``'s output after a JSON round trip (lists back to tuples)."""
        return cls(tuple(int(t) for t in fields["token_ids"]), tuple(float(x) for x in fields["logprobs"]),
                   tuple(int(r) for r in fields["ranks"]),
                   tuple(tuple((int(t), float(p)) for t, p in top) for top in fields["top"]))


@dataclass(frozen=True, slots=True)
class SLOTarget:
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """Everything a worker needs to run one request; made once by the router (or a test)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    slo: SLOTarget = field(default_factory=SLOTarget)
    priority: int = 0           # lower value runs first (vLLM's convention)
    arrival_s: float = field(default_factory=time.monotonic)
    # A migrated request resumes elsewhere with the tokens it already streamed appended to its
    # prompt: the last ``num_generated`` prompt tokens are output, so sampling positions (seeded
    # sampling) and stop strings continue where they were.
    num_generated: int = 0
    # W3C traceparent of the router's span for this request (engine/tracing.py); None: untraced.
    traceparent: str | None = None

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whoever prefills it computes its prompt logprobs, so every prompt position and nothing
        read from a prefix cache (a migrated request streamed tokens: it had them already). The
        engine's rule, and the router's: such a prompt expects no hit where it is prefilled."""
        return self.sampling.prompt_logprobs is not None and self.num_generated == 0


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request produced by one engine step."""

    req_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[float, ...] | None = None
    error: str | None = None    # set with FinishReason.ERROR
    # On a request's first token when this engine prefilled it: prompt tokens it found cached.
    num_cached_tokens: int = 0
    top_logprobs: tuple[TopLogprobs, ...] | None = None   # one per token id when sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None   # on the first delta, with sampling.prompt_logprobs
    # With error: the sampling field whose constraints left nothing to generate (a structured
    # output whose grammar cannot go on, every token ruled out): the client's mistake, answered
    # INVALID_ARGUMENT naming it. None: a failure of ours.
    error_field: str | None = None
    # Prefill role, a request that ended at its first token (no hand-off, so no PrefillDone):
    # its queue and compute seconds, which its result and trace report.
    phase_s: tuple[float, float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class KVEventKind(str, enum.Enum):
    STORED = "stored"        # a full block's content became findable in the worker's prefix cache
    REMOVED = "removed"      # it is no longer (evicted, or its parent's content was)


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change to a worker's prefix cache (Dynamo's KV events), numbered per worker: the
    router's prefix index applies them in order, skips repeats and notices gaps."""

    seq: int
    kind: KVEventKind
    block_hash: int


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One engine step: its shape and how long it took (admission fits a step-time model on these)."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_kv_tokens: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What a worker reports to the router for admission and pair choice."""

    worker_id: str
    role: str
    num_waiting: int
    num_running: int
    num_waiting_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_preemptions: int = 0
    recent_steps: tuple[StepTiming, ...] = ()
    # Running totals: prompt tokens that looked for a cached prefix, and those found (a decode
    # worker counts the prompts it reserves for: a hit there is KV not transferred).
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Of the blocks not free, those held by reservations whose KV has not landed (decode role):
    # the router still counts them among its own promises (``WorkerHandle.free_blocks``).
    num_parked_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        used = self.num_total_blocks - self.num_free_blocks
        return used / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one worker's paged KV cache; both sides of a hand-off must agree on it exactly.

    The cache is one contiguous tensor of shape
    ``[num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str                  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv heads x head dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class HandoffOutcome(str, enum.Enum):
    """How a request's prefill reached (or did not reach) its decode worker."""

    OK = "ok"                              # KV moved into the reserved blocks, decode committed
    ENDED_AT_PREFILL = "ended_at_prefill"  # finished with its first token (EOS, max_tokens=1) or failed there
    ABORTED = "aborted"                    # cancelled before the hand-off
    RESERVE_REFUSED = "reserve_refused"    # the decode worker had no room for the prompt's blocks
    RESERVE_FAILED = "reserve_failed"      # the decode worker's reserve raised anything else
    TRANSFER_FAILED = "transfer_failed"    # the bytes did not land (or the lease ran out): recompute
    GROUP_CHANGED = "group_changed"        # set up in a KV group formed again since: recompute (the link is fine)
    PEER_DEAD = "peer_dead"                # the decode worker died during the hand-off
    LOCAL = "prefilled_locally"            # no prefill worker: the decode worker prefilled it


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A prefill worker's first token, streamed ahead of its ``PrefillResult`` once the decode
    worker's reservation holds and the KV starts moving: the client gets it without waiting for
    the hand-off. Safe to send early: if the hand-off then fails, the request is recomputed (or
    migrated) with this token as part of its prompt, so it is never sent twice."""

    req_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None   # with sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None   # with sampling.prompt_logprobs
    # The prefill worker's part of the first token's path (``router.orchestrator.FirstTokenPath``),
    # wall clock (``time.time``: comparable with the router's on one node): when its ``prefill``
    # call arrived, when this token left; and the engine's own queue and compute time between,
    # and how long the token waited for the decode worker's reservation after it was sampled.
    received_s: float = 0.0
    sent_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    reserve_wait_s: float = 0.0

    def to_json(self) -> bytes:
        """One line for the router's first-token inbox (JSON: nothing but data crosses a socket)."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, line: bytes) -> FirstToken:
        fields = json.loads(line)
        top = fields.get("top_logprobs")
        if top is not None:
            fields["top_logprobs"] = tuple((int(t), float(p)) for t, p in top)
        if fields.get("prompt_logprobs") is not None:
            fields["prompt_logprobs"] = PromptLogprobs.from_plain(fields["prompt_logprobs"])
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class PrefillSubmission:
    """A prefill call sent by the router straight to a prefill worker on its node (a unix socket:
    ``prefill_worker/submissions.py``), just before the same call on Ray, which joins the
    request it started: the compute starts without Ray's submission on the first token's path
    (~0.4 ms instead of ~2-7 ms), while Ray's call stays the one that reports the result and the
    worker's death. ``decode_id``: the decode actor's id (its handle cannot cross a socket; the
    worker knows it from earlier Ray calls, else ignores the submission and waits for Ray's)."""

    spec: RequestSpec
    transport: str
    decode_id: str
    inbox: str | None = None   # the router's first-token inbox

    def to_json(self) -> bytes:
        """One line (JSON: nothing but data crosses a socket)."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, line: bytes) -> PrefillSubmission:
        fields = json.loads(line)
        spec = fields["spec"]
        sampling = SamplingParams.from_plain(spec["sampling"])
        spec = RequestSpec(**{**spec, "prompt_token_ids": tuple(spec["prompt_token_ids"]), "sampling": sampling,
                              "slo": SLOTarget(**spec["slo"])})
        return cls(spec, fields["transport"], fields["decode_id"], fields["inbox"])


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill worker returns once a request's KV has landed in its decode worker (or
    did not: ``outcome``). Its first token may have gone ahead as a ``FirstToken``.

    ``finish_reason`` is set when the request ended at prefill (EOS or max_tokens reached with
    the first token, aborted, failed); then no KV was handed over.
    """

    req_id: str
    first_token_id: int | None
    finish_reason: FinishReason | None = None
    first_logprob: float | None = None
    error: str | None = None
    queue_s: float = 0.0        # worker arrival -> first scheduled
    prefill_s: float = 0.0      # first scheduled -> first token sampled
    transfer_s: float = 0.0     # KV hand-off, including the decode side's commit
    transfer_bytes: int = 0
    transport: str = ""
    stats: WorkerStats | None = None   # the prefill worker's stats when it answered
    outcome: HandoffOutcome = HandoffOutcome.OK
    cached_tokens: int = 0         # prompt tokens the prefill worker found in its prefix cache
    decode_cached_tokens: int = 0  # prompt tokens whose KV the decode worker held already
    saved_bytes: int = 0           # KV bytes not moved thanks to that
    first_top_logprobs: TopLogprobs | None = None   # with sampling.top_logprobs > 0
    kv_events: tuple[KVEvent, ...] = ()   # its prefix-cache changes not yet reported
    prompt_logprobs: PromptLogprobs | None = None   # with sampling.prompt_logprobs
    error_field: str | None = None   # with error: TokenDelta.error_field's


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """One decode-worker step for every request it holds: the unit of its output stream."""

    worker_id: str
    deltas: tuple[TokenDelta, ...]
    stats: WorkerStats | None = None
    kv_events: tuple[KVEvent, ...] = ()   # its prefix-cache changes since the previous batch
