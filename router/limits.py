"""What one client may ask of the server: the limits that keep one request from hurting others.

Every limit is a server option (``pdserve serve`` flags, ``ServerLimits`` in ``ServerDefaults``)
with a default sized for a public endpoint, and is reported in ``ServerInfo.limits`` (but
``http_receive_timeout_s``: the HTTP door's own, nothing a gRPC client can act on). The checks
that need only the request message (``check_request``) run before any tokenizer sees the prompt,
so a huge prompt costs its bytes and nothing more. A request past a limit is refused with
INVALID_ARGUMENT naming the field; load limits (concurrent streams, admission queue, a stream
whose reader falls behind) answer RESOURCE_EXHAUSTED at once. SLO hints are clamped, not refused;
priority is honoured only under the ``priority`` scheduling policy, and then only in range.
Torch-free.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.errors import ConfigError, require
from protos import pdserve_pb2 as pb

MIB = 1 << 20


class SchedulingPolicy(str, enum.Enum):
    """vLLM's names. FCFS ignores the client's priority (every request gets 0)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


def _limit(default, help_text: str | None = None):
    """A limit's default and its ``pdserve serve`` help (None: explained by the flag before it)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Each field is a ``--flag`` of ``pdserve serve`` (deploy/cli.py reads the fields and their help)."""

    max_stop_strings: int = _limit(16, "stop strings per request")
    max_stop_string_chars: int = _limit(256, "characters per stop string")
    max_stop_token_ids: int = _limit(64, "stop token ids per request")
    max_prompt_bytes: int = _limit(MIB, "UTF-8 bytes of a text or chat prompt (a chat's messages, tools and "
                                        "template variables), checked before tokenizing")
    max_chat_messages: int = _limit(512, "messages per chat prompt")
    max_structured_output_chars: int = _limit(
        65_536, "characters of a structured output's JSON schema, regex, grammar or choices (all together)")
    # gRPC's own cap on one incoming message: room for a max_prompt_bytes prompt plus its
    # framing, and for token_ids prompts (an id is up to 10 bytes on the wire).
    max_receive_message_bytes: int = _limit(4 * MIB, "gRPC's cap on one incoming message")
    # HTTP only (gRPC's calls have the client's deadline and core's keepalive): a request head
    # that never ends holds a file descriptor, a body that stalls one of the places for bodies.
    http_receive_timeout_s: float = _limit(60.0, "seconds an HTTP request's head, then its body, may take to "
                                                 "arrive: a late head closes the connection, a late body gets 408")
    max_concurrent_streams: int = _limit(256, "live Generate calls; more get RESOURCE_EXHAUSTED at once")
    max_queued_requests: int = _limit(128, "requests waiting in admission; more get RESOURCE_EXHAUSTED at once")
    max_pending_tokens: int = _limit(4096, "tokens a stream's reader may leave unread before it is cancelled")
    stream_interval: int = _limit(1, "tokens per stream message (vLLM's --stream-interval): a stream's first "
                                     "tokens and its last go at once, the rest when this many are pending; "
                                     "larger costs the router less per token, the client a burstier stream")
    min_ttft_ms: float = _limit(10.0, "client TTFT hints are clamped into [min, max]")
    max_ttft_ms: float = _limit(600_000.0)
    min_tpot_ms: float = _limit(1.0, "client TPOT hints are clamped into [min, max]")
    max_tpot_ms: float = _limit(60_000.0)
    scheduling_policy: SchedulingPolicy = _limit(
        SchedulingPolicy.FCFS, "fcfs ignores the client's priority; priority honours it within the range")
    min_priority: int = _limit(0, "with --scheduling-policy priority: the priorities accepted (lower runs first)")
    max_priority: int = _limit(10)

    def __post_init__(self) -> None:
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise ConfigError.on(name, f"must be >= 1, got {getattr(self, name)}")
            if getattr(self, name) > MAX_COUNT:
                raise ConfigError.on(name, f"must be at most 2^30 (gRPC's arguments are 32-bit), got {getattr(self, name)}")
        for name in ("min_ttft_ms", "min_tpot_ms", "http_receive_timeout_s", "max_ttft_ms", "max_tpot_ms"):
            if not getattr(self, name) > 0:
                raise ConfigError.on(name, f"must be > 0, got {getattr(self, name)}")
            if not math.isfinite(getattr(self, name)):   # a NaN bound passed every comparison (a probe)
                raise ConfigError.on(name, f"must be a finite number, got {getattr(self, name)}")
        for low, high in (("min_ttft_ms", "max_ttft_ms"), ("min_tpot_ms", "max_tpot_ms"), ("min_priority", "max_priority")):
            if getattr(self, low) > getattr(self, high):
                raise ConfigError(f"{{{low}}} {getattr(self, low)} is above {{{high}}} {getattr(self, high)}")
        if not 1 <= self.stream_interval <= self.max_pending_tokens:
            raise ConfigError("{stream_interval} must be in [1, {max_pending_tokens}]")



# Limits that count something: none of them can be 0 (or less) and leave a usable server, nor
# past 2^30: gRPC's channel arguments are 32-bit (twice max_concurrent_streams is one), and a
# larger value ended a started cluster with a traceback (found by a probe).
MAX_COUNT = 2**30
_COUNTS = ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", "max_prompt_bytes", "max_chat_messages",
           "max_structured_output_chars", "max_receive_message_bytes", "max_concurrent_streams", "max_queued_requests", "max_pending_tokens")


def check_request(request: pb.GenerateRequest, limits: ServerLimits) -> None:
    """The limits a message can be checked against before tokenizing: prompt bytes, chat length,
    stop strings, bad words and stop token ids. Raises InvalidRequestError naming the field."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        _check_bytes("text", len(request.text.encode("utf-8")), limits)
    elif kind == "chat":
        n = len(request.chat.messages)
        require(n <= limits.max_chat_messages, "chat.messages", f"{n} messages; at most {limits.max_chat_messages}")
        _check_bytes("chat", _chat_bytes(request.chat), limits)
    _check_stops(request.sampling, limits)
    _check_structured_output(request.sampling.structured_output, limits)


def _chat_bytes(chat: pb.ChatMessages) -> int:
    """What the chat template renders into the prompt: every message's text fields (roles are a
    fixed set), the tools and the template's variables."""
    def utf8(text: str) -> int:
        return len(text.encode("utf-8"))

    size = sum(utf8(m.content) + utf8(m.tool_calls_json) + utf8(m.tool_call_id) + utf8(m.name) for m in chat.messages)
    return size + utf8(chat.tools_json) + utf8(chat.template_kwargs_json)


def _check_structured_output(guide: pb.StructuredOutput, limits: ServerLimits) -> None:
    """Its text's size, before llguidance compiles it (a compile's time grows with it)."""
    kind = guide.WhichOneof("kind")
    size = sum(map(len, guide.choice.choices)) if kind == "choice" else len(getattr(guide, kind)) \
        if kind in ("json", "regex", "grammar") else 0
    require(size <= limits.max_structured_output_chars, f"sampling.structured_output.{kind}",
            f"{size} characters; at most {limits.max_structured_output_chars}")


def _check_bytes(field: str, size: int, limits: ServerLimits) -> None:
    require(size <= limits.max_prompt_bytes, field, f"prompt is {size} bytes; at most {limits.max_prompt_bytes}")


def _check_stops(sampling: pb.SamplingParams, limits: ServerLimits) -> None:
    """Stop strings, and bad words (strings the engine matches against the output too), by one rule."""
    for name in ("stop", "bad_words"):
        strings = getattr(sampling, name)
        n = len(strings)
        require(n <= limits.max_stop_strings, f"sampling.{name}", f"{n} strings; at most {limits.max_stop_strings}")
        for i, s in enumerate(strings):
            require(len(s) <= limits.max_stop_string_chars, f"sampling.{name}[{i}]",
                     f"{len(s)} characters; at most {limits.max_stop_string_chars}")
    n = len(sampling.stop_token_ids)
    require(n <= limits.max_stop_token_ids, "sampling.stop_token_ids",
             f"{n} stop token ids; at most {limits.max_stop_token_ids}")


def clamp_hint_ms(field: str, ms: float, limits: ServerLimits) -> float:
    """A client SLO hint clamped into the server's range (a 1 µs TTFT target would make admission
    reject everything; a week-long one would let a request queue forever). Not a number > 0 is
    the client's mistake."""
    require(math.isfinite(ms) and ms > 0, field, f"must be > 0 milliseconds, got {ms}")
    low, high = (limits.min_ttft_ms, limits.max_ttft_ms) if field == "ttft_ms" else (limits.min_tpot_ms, limits.max_tpot_ms)
    return min(high, max(low, ms))


def priority_for(request: pb.GenerateRequest, limits: ServerLimits) -> int:
    """The priority a request runs at: 0 under FCFS whatever it asked; its own under the
    priority policy, which must be within the configured range."""
    if limits.scheduling_policy is not SchedulingPolicy.PRIORITY:
        return 0
    if not request.HasField("priority"):
        return min(max(0, limits.min_priority), limits.max_priority)
    p = request.priority
    require(limits.min_priority <= p <= limits.max_priority, "priority",
             f"{p} is outside [{limits.min_priority}, {limits.max_priority}]")
    return p


_POLICY_TO_PROTO = {SchedulingPolicy.FCFS: pb.SCHEDULING_POLICY_FCFS,
                    SchedulingPolicy.PRIORITY: pb.SCHEDULING_POLICY_PRIORITY}


def limits_to_proto(limits: ServerLimits) -> dict:
    """The ``Limits`` message fields this module owns (convert adds the model's)."""
    return dict(
        max_stop_strings=limits.max_stop_strings, max_stop_string_chars=limits.max_stop_string_chars,
        max_stop_token_ids=limits.max_stop_token_ids, max_prompt_bytes=limits.max_prompt_bytes,
        max_chat_messages=limits.max_chat_messages, max_structured_output_chars=limits.max_structured_output_chars,
        max_receive_message_bytes=limits.max_receive_message_bytes,
        max_concurrent_streams=limits.max_concurrent_streams, max_queued_requests=limits.max_queued_requests,
        max_pending_tokens=limits.max_pending_tokens, stream_interval=limits.stream_interval,
        ttft_ms_range=pb.Range(min=limits.min_ttft_ms, max=limits.max_ttft_ms),
        tpot_ms_range=pb.Range(min=limits.min_tpot_ms, max=limits.max_tpot_ms),
        scheduling_policy=_POLICY_TO_PROTO[limits.scheduling_policy],
        min_priority=limits.min_priority, max_priority=limits.max_priority,
    )
