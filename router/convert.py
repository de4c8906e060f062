"""Proto <-> engine conversion for the router: validation, explicit defaults, incremental text.

Life cycle of one Generate call, as far as this module goes:

1. ``label_from_proto`` checks the client's ``request_id``, a label only (the router runs the
   request under its own id: ``router.identity``); ``router.limits.check_request`` checks sizes.
2. ``prompt_from_proto(request, tokenizer)`` (off the event loop: it may be slow) turns the ``prompt`` oneof (text, chat or token ids)
   into token ids; a chat is checked and rendered by ``router.chat_prompt``.
3. ``spec_from_proto(request, prompt_token_ids, defaults, req_id)`` checks everything else and
   fills every unset field from ``ServerDefaults``. The frozen ``RequestSpec`` it returns is what
   the workers trust. Any problem raises ``InvalidRequestError(field, message)``, which the
   service maps to INVALID_ARGUMENT before anything is queued. ``field`` is a proto path
   (``sampling.top_p``, ``token_ids``, ``chat.messages[1].role``) because that is what the client
   wrote; ``engine.validation`` then runs the engine's own checks on the finished spec.
4. Per ``TokenDelta`` streamed back by a worker, the request's ``IncrementalDetokenizer`` turns
   the new ids into new text and ``delta_to_proto`` builds the stream message; the last one
   carries finish reason, ``Usage`` and ``RequestTimings``.

Stop strings are the engine's job (it must stop generating, not just hide text), never this
module's. Torch-free: the tokenizer is passed in and duck-typed, so importing this module never
loads torch or transformers.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import InvalidRequestError, require
from engine import grammar
from engine.grammar import choices_spec
from engine.types import (FinishReason, GuideKind, RequestSpec, SamplingParams, SLOTarget, StructuredOutput, TokenDelta,
                          TopLogprobs, WorkerStats)
from engine.validation import check_token_ids, validate_sampling, validate_spec
from protos import pdserve_pb2 as pb
from router.chat_prompt import chat_from_proto, encode_chat
from router.limits import ServerLimits, clamp_hint_ms, limits_to_proto, priority_for

MAX_REQUEST_ID_LEN = 256
REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the router uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]: ...


@dataclass(frozen=True, slots=True)
class ServerDefaults:
    """What an unset request field means on this server, and the model's hard limits."""

    max_model_len: int
    vocab_size: int
    max_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()   # the model's: what min_tokens holds back
    temperature: float = 0.0     # greedy: reproducible unless the client asks for sampling
    top_p: float = 1.0
    top_k: int = 0               # 0 disables top-k
    ttft_s: float | None = None  # default SLO targets; None = best effort
    tpot_s: float | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Life-cycle durations of one request in seconds; field for field the proto's ``Timings``."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0
    kv_transfer_bytes: int = 0
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    kv_handoff: str = ""            # a HandoffOutcome value; "" in colocated mode
    recomputed_on_decode: bool = False
    migrations: int = 0
    prefill_cached_tokens: int = 0  # prefix caching: not computed by the worker that prefilled
    decode_cached_tokens: int = 0   # held by the decode worker already: not moved
    kv_transfer_saved_bytes: int = 0
    # The first token's path outside the engine (the proto's Timings says what each spans).
    admission_s: float = 0.0
    dispatch_s: float = 0.0
    to_prefill_worker_s: float = 0.0
    prefill_worker_overhead_s: float = 0.0
    first_token_return_s: float = 0.0
    reservation_wait_s: float = 0.0


# ---------------------------------------------------------------- request -> engine



def label_from_proto(request: pb.GenerateRequest) -> str | None:
    """The client's request_id, checked; None when unset. A label only: the router runs every
    request under its own id (``router.identity``)."""
    if not request.HasField("request_id"):
        return None
    rid = request.request_id
    require(0 < len(rid) <= MAX_REQUEST_ID_LEN, "request_id", f"must be 1 to {MAX_REQUEST_ID_LEN} characters")
    # Echoed in responses and written to logs: a control character (a newline) would forge log lines.
    require(rid.isprintable(), "request_id", "must be printable text (no control characters)")
    return rid


def req_id_from_proto(request: pb.GenerateRequest) -> str:
    """The client's label, or a fresh uuid (tests and tools that make specs without a router)."""
    label = label_from_proto(request)
    return uuid.uuid4().hex if label is None else label


def prompt_from_proto(request: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the prompt. Length and vocabulary checks are ``spec_from_proto``'s."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        require(request.text, "text", "empty prompt")
        # encode() adds exactly the special tokens the tokenizer adds by default (Llama's BOS,
        # nothing for SmolLM2): the ids transformers itself would feed the model for this text.
        return list(tokenizer.encode(request.text))
    if kind == "chat":
        return encode_chat(chat_from_proto(request.chat), tokenizer)
    if kind == "token_ids":
        return list(request.token_ids.ids)
    raise InvalidRequestError("prompt", "set one of text, chat or token_ids")


# Optional scalar fields whose unset meaning is SamplingParams' own default (the server has none of its own).
_SAMPLING_AS_IS = ("min_p", "min_tokens", "seed", "ignore_eos", "include_stop_str_in_output", "logprobs",
                   "top_logprobs", "prompt_logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty")


def sampling_from_proto(msg: pb.SamplingParams, defaults: ServerDefaults) -> SamplingParams:
    """Unset fields take ``defaults`` (presence, not zero, decides), or SamplingParams' own where
    the server sets none. Prompt-dependent limits (prompt + max_tokens) are checked by ``spec_from_proto``."""

    def get(name: str, default: Any) -> Any:
        return getattr(msg, name) if msg.HasField(name) else default

    sp = SamplingParams(
        max_tokens=get("max_tokens", defaults.max_tokens),
        temperature=get("temperature", defaults.temperature),
        top_p=get("top_p", defaults.top_p),
        top_k=get("top_k", defaults.top_k),
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(sorted(msg.logit_bias.items())),   # a map's order is not the wire's: sorted, one spec
        allowed_token_ids=tuple(msg.allowed_token_ids),
        structured_output=structured_output_from_proto(msg.structured_output) if msg.HasField("structured_output") else None,
        **{name: getattr(msg, name) for name in _SAMPLING_AS_IS if msg.HasField(name)},
    )
    validate_sampling(sp, defaults.vocab_size, prefix="sampling.", eos_token_ids=defaults.eos_token_ids)
    if sp.structured_output is not None:   # compiled here (on the tokenizer pool) before any worker sees it
        grammar.check(sp.structured_output, "sampling.structured_output")
    return sp


def structured_output_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    """The proto's kind names are ``GuideKind``'s values; choices travel as one JSON list."""
    kind = msg.WhichOneof("kind")
    require(kind is not None, "sampling.structured_output", "set one of json, json_object, regex, choice, grammar")
    if kind == "json_object":
        require(msg.json_object, "sampling.structured_output.json_object", "must be true when set")
        return StructuredOutput(GuideKind.JSON_OBJECT)
    if kind == "choice":
        return StructuredOutput(GuideKind.CHOICE, choices_spec(msg.choice.choices))
    return StructuredOutput(GuideKind(kind), getattr(msg, kind))


def _slo_hint(request: pb.GenerateRequest, name: str, defaults: ServerDefaults) -> float | None:
    if not request.HasField(name):
        return getattr(defaults, name.replace("_ms", "_s"))
    return clamp_hint_ms(name, getattr(request, name), defaults.limits) / 1000.0


def _prompt_field(request: pb.GenerateRequest) -> str:
    return request.WhichOneof("prompt") or "prompt"


def bad_words_from_proto(sampling: pb.SamplingParams, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad words as token ids (its rule): each word, leading spaces stripped, as the tokenizer
    encodes it alone; and with one leading space where that gives a different first token in as
    many tokens (a word mid-sentence)."""
    words = []
    for i, word in enumerate(sampling.bad_words):
        require(word.strip(), f"sampling.bad_words[{i}]", "must not be empty or only spaces")
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        words.append(alone)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            words.append(spaced)
    return tuple(words)


def spec_from_proto(
    request: pb.GenerateRequest, prompt_token_ids: Sequence[int], defaults: ServerDefaults, req_id: str,
    bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
) -> RequestSpec:
    """Validate the request and fill every default: the one place a ``RequestSpec`` is made.
    ``bad_words_token_ids``: ``bad_words_from_proto``'s (it needs the tokenizer)."""
    field, limit = _prompt_field(request), defaults.max_model_len
    prompt_token_ids = _truncated(request.sampling, prompt_token_ids, limit)
    n = len(prompt_token_ids)
    require(n, field, "empty prompt")
    # Length first: a huge prompt is refused before any per-token work (that work runs on the
    # router's event loop for token_ids prompts).
    require(n < limit, field, f"prompt has {n} tokens; max_model_len is {limit} and one token must be generated")
    prompt = tuple(int(t) for t in prompt_token_ids)
    check_token_ids(prompt, defaults.vocab_size, field)
    sampling = sampling_from_proto(request.sampling, defaults)
    if not skip_special_tokens_from_proto(request):   # a request-level field: the text stop strings are found in
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    if bad_words_token_ids:
        sampling = dataclasses.replace(sampling, bad_words_token_ids=bad_words_token_ids)
    room = limit - len(prompt)
    if request.sampling.HasField("max_tokens"):
        # An explicit value is a promise we could not keep: refuse rather than silently cut it.
        require(sampling.max_tokens <= room, "sampling.max_tokens",
                f"{len(prompt)} prompt tokens + {sampling.max_tokens} to generate exceed max_model_len {limit}")
    elif sampling.max_tokens > room:
        # The server's default was never the client's promise: it shrinks to fit a long prompt.
        sampling = dataclasses.replace(sampling, max_tokens=room)
    slo = SLOTarget(ttft_s=_slo_hint(request, "ttft_ms", defaults), tpot_s=_slo_hint(request, "tpot_ms", defaults))
    priority = priority_for(request, defaults.limits)
    spec = RequestSpec(req_id=req_id, prompt_token_ids=prompt, sampling=sampling, slo=slo, priority=priority)
    # The engine re-checks every spec on add_request; running its checks here too means a spec
    # the engine would refuse is refused now, before it is queued, whatever either side adds.
    validate_spec(spec, max_model_len=limit, vocab_size=defaults.vocab_size, eos_token_ids=defaults.eos_token_ids)
    return spec


def _truncated(sampling: pb.SamplingParams, prompt_token_ids: Sequence[int], limit: int) -> Sequence[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens (-1: ``max_model_len``), kept
    before the length check, so a long prompt is cut rather than refused."""
    if not sampling.HasField("truncate_prompt_tokens"):
        return prompt_token_ids
    keep = sampling.truncate_prompt_tokens
    keep = limit if keep == -1 else keep
    require(1 <= keep <= limit, "sampling.truncate_prompt_tokens",
            f"must be -1 (max_model_len) or in [1, {limit}], got {sampling.truncate_prompt_tokens}")
    return prompt_token_ids[-keep:]


def skip_special_tokens_from_proto(request: pb.GenerateRequest) -> bool:
    return request.skip_special_tokens if request.HasField("skip_special_tokens") else True


# ---------------------------------------------------------------- engine -> response

_FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
_ROLE_TO_PROTO = {
    "prefill": pb.WORKER_ROLE_PREFILL,
    "decode": pb.WORKER_ROLE_DECODE,
    "colocated": pb.WORKER_ROLE_COLOCATED,
}
_MODE_TO_PROTO = {"disaggregated": pb.SERVING_MODE_DISAGGREGATED, "colocated": pb.SERVING_MODE_COLOCATED}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO.get(value)  # a newer server's unknown reason reads as "not finished"


_TIMINGS_FIELDS = tuple(f.name for f in dataclasses.fields(RequestTimings))   # flat scalars, as in the proto


def timings_to_proto(t: RequestTimings) -> pb.Timings:
    # Not dataclasses.asdict: it deep-copies every field (a request's last message pays it).
    return pb.Timings(**{name: getattr(t, name) for name in _TIMINGS_FIELDS})


def timings_from_proto(msg: pb.Timings) -> RequestTimings:
    return RequestTimings(**{name: getattr(msg, name) for name in _TIMINGS_FIELDS})


def usage_from_proto(msg: pb.Usage) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens)


def _top_to_proto(top: TopLogprobs) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def delta_to_proto(
    delta: TokenDelta, text: str, *, usage: Usage | None = None, timings: RequestTimings | None = None,
    request_id: str | None = None,
) -> pb.GenerateResponse:
    """One stream message. Pass ``usage`` and ``timings`` with the finishing delta only;
    ``request_id`` names it (default: the delta's). Built per message: only the fields a delta
    carries are set (an empty repeated field passed to the constructor costs as much as a full one)."""
    msg = pb.GenerateResponse(request_id=delta.req_id if request_id is None else request_id,
                              token_ids=delta.token_ids, text=text)
    if delta.finish_reason is not None:
        msg.finish_reason = finish_reason_to_proto(delta.finish_reason)
    if delta.logprobs:
        msg.logprobs.extend(delta.logprobs)
    if delta.error:
        msg.error = delta.error
    if delta.top_logprobs:
        msg.top_logprobs.extend(_top_to_proto(top) for top in delta.top_logprobs)
    if delta.prompt_logprobs is not None:
        prompt = msg.prompt_logprobs
        prompt.SetInParent()   # present even for a one-token prompt (no logprob to list)
        prompt.token_ids.extend(delta.prompt_logprobs.token_ids)
        prompt.logprobs.extend(delta.prompt_logprobs.logprobs)
        prompt.ranks.extend(delta.prompt_logprobs.ranks)
        prompt.top_logprobs.extend(_top_to_proto(top) for top in delta.prompt_logprobs.top)
    if usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens))
    if timings is not None:
        msg.timings.CopyFrom(timings_to_proto(timings))
    return msg


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker slot as ServerInfo reports it: its state, restarts and last stats (None before
    its first report, or while it restarts)."""

    worker_id: str
    role: str
    state: str          # a router.registry.WorkerState value
    restarts: int
    stats: WorkerStats | None = None


def worker_info_to_proto(stats: WorkerStats) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=stats.worker_id,
        role=_ROLE_TO_PROTO.get(stats.role, pb.WORKER_ROLE_UNSPECIFIED),
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_tokens=stats.num_waiting_tokens,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
    )


def worker_status_to_proto(status: WorkerStatus) -> pb.WorkerInfo:
    msg = worker_info_to_proto(status.stats) if status.stats is not None else pb.WorkerInfo(worker_id=status.worker_id)
    msg.role = _ROLE_TO_PROTO.get(status.role, pb.WORKER_ROLE_UNSPECIFIED)
    msg.state, msg.restarts = status.state, status.restarts
    return msg


def server_info_to_proto(
    defaults: ServerDefaults, *, model: str, block_size: int, mode: str, workers: Sequence[WorkerStats] = (),
    statuses: Sequence[WorkerStatus] = (),
) -> pb.ServerInfoResponse:
    """``mode`` is "disaggregated" or "colocated"; ``workers`` (stats only) or ``statuses``."""
    msg = pb.ServerInfoResponse(
        model=model,
        max_model_len=defaults.max_model_len,
        vocab_size=defaults.vocab_size,
        block_size=block_size,
        mode=_MODE_TO_PROTO.get(mode, pb.SERVING_MODE_UNSPECIFIED),
        workers=[worker_info_to_proto(w) for w in workers] + [worker_status_to_proto(w) for w in statuses],
        limits=pb.Limits(max_prompt_tokens=defaults.max_model_len - 1, max_tokens=defaults.max_model_len - 1,
                         default_max_tokens=defaults.max_tokens, **limits_to_proto(defaults.limits)),
    )
    if defaults.ttft_s is not None:
        msg.default_slo.ttft_ms = defaults.ttft_s * 1000.0
    if defaults.tpot_s is not None:
        msg.default_slo.tpot_ms = defaults.tpot_s * 1000.0
    return msg


# ---------------------------------------------------------------- incremental text


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas that never split a UTF-8 character.

    Byte-level BPE may spend several tokens on one character (an emoji is 4 bytes), and a token
    decoded alone gives U+FFFD. As TGI and vLLM do, each step decodes a short window twice: the
    already-emitted context ``[prefix, read)`` and the context plus the unread tokens
    ``[prefix, end)``; the difference is emitted once it no longer ends in U+FFFD, and the
    window slides. Decoding with left context (not the new ids alone) also keeps SentencePiece's
    word-leading spaces right. Cost per step: two decodes of a few tokens.

    Life cycle: made when the request is admitted (seeded with the prompt's last ids), ``push``
    per delta, ``push(..., finished=True)`` once; then dropped.
    """

    CONTEXT = 5  # prompt ids used as left context, as vLLM does

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self.CONTEXT:]) if self.CONTEXT else []
        self._num_context = len(self._ids)
        self._prefix = 0               # start of the decode window
        self._read = len(self._ids)    # ids before this one are already emitted as text

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def push(self, token_ids: Sequence[int], *, finished: bool = False) -> str:
        """New text for ``token_ids``. With ``finished`` it lets out whatever is held back but a
        character the output's last bytes left incomplete (max_tokens cut it): vLLM's detokenizer
        never emits one either. So the concatenated deltas equal ``decode(output_token_ids)``
        less a trailing U+FFFD."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        # Hold back while the last character is incomplete or the new ids decode to nothing
        # (skipped special tokens); the next step decodes them again with more bytes.
        if not finished and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        text = full_text[len(prefix_text):]
        return text.rstrip(REPLACEMENT_CHAR) if finished else text

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)
