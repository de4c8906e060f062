"""The request path both front doors share: gRPC (``router.server``) and the OpenAI-compatible
HTTP API (``router.openai_api``) each turn their wire format into a ``GenerateRequest`` and hand
it here, so limits, identity, tokenizing, admission, metrics and error words are written once.

Life cycle of one request: ``claim`` (the message parsed, its size limits before any tokenizer
runs, its label: ``router.identity``; cheap, so a duplicate or an over-limit call costs nothing)
-> ``stream`` (token ids on the tokenizer pool, never on the event loop -> validated
``RequestSpec`` -> ``Orchestrator.generate`` -> incremental UTF-8 safe text (stop strings
trimmed: ``router.stop_text``) -> one
``GenerationEvent`` per (possibly merged) delta; the last carries usage and timings; the
request's outcome is recorded in the metrics however it ends) -> ``release`` (always). An
error anywhere becomes one status and message through ``failure`` (``router.errors``: never a
worker's text). The consumer's task is the one the request's ``DeltaQueue`` cancels with
``SLOW_READER`` when its client stops reading, and the one ``LiveRequests.cut`` cancels with
``CUT_AT_STOP`` at a stop: ``server_cancel`` recognises those two cancels of the server's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

import grpc

from engine import tracing
from engine.errors import CapacityError, InvalidRequestError
from engine.types import FinishReason, RequestSpec, TokenDelta
from engine.validation import check_token_ids
from protos import pdserve_pb2 as pb
from router import convert, limits as request_limits
from router.chat_prompt import chat_from_proto
from router.convert import IncrementalDetokenizer, RequestTimings, ServerDefaults, Usage
from router.delta_queue import QUEUE_POLICY, SLOW_READER, QueuePolicy, SlowReaderError
from router.errors import RequestFailedError, fault_of, status_for
from router.identity import (CUT_AT_STOP, ENDING_WAIT_S, RACE_WAIT_S, DuplicateRequestError, LiveRequests,
                             RequestIdentity, ShuttingDownError)
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, RequestTrace
from router.stop_text import StopTextTrimmer

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 2       # HF fast tokenizers release the GIL: two prompts tokenize at once


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """A request message that did not parse (e.g. invalid UTF-8 in a string field)."""

    error: str

    def refusal(self, message_type: str) -> InvalidRequestError:
        # protobuf's own reason ("String field had bad UTF-8", "Wire format was corrupt"),
        # without its "Error parsing message with type ...:" preamble
        return InvalidRequestError("request", f"not a valid {message_type}: {self.error.rsplit(': ', 1)[-1]}")


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One step's output for the client: the delta, its text, and with the last one the totals."""

    delta: TokenDelta
    text: str
    usage: Usage | None = None            # last event only
    timings: RequestTimings | None = None  # last event only
    # last event only: the stop string or stop token id that ended it (vLLM's ``stop_reason``);
    # None for EOS, a length or any other end
    stop_reason: str | int | None = None


def _rejected_as(exc: Exception) -> str:
    """The ``reason`` label a refusal (on arrival, or by admission) is counted under."""
    if isinstance(exc, CapacityError):
        return exc.reason
    return "duplicate_id" if isinstance(exc, DuplicateRequestError) else "shutting_down"


class GenerationCore:
    def __init__(self, orchestrator: Orchestrator, tokenizer: Any | None, defaults: ServerDefaults,
                 metrics: RouterMetrics | None = None) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.limits = defaults.limits
        self.metrics = metrics
        self.live = LiveRequests(self.limits.max_concurrent_streams)
        self._queue_policy = QueuePolicy(self.limits.max_pending_tokens, self.limits.stream_interval)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pdserve-tokenize")

    # ---- one request ------------------------------------------------------------------------
    async def claim(self, request: pb.GenerateRequest | MalformedRequest) -> RequestIdentity:
        """Cheap checks, before any tokenizer runs: the message parsed, its sizes, its label (one
        a request still holds is waited for a moment first: router/identity.py)."""
        if isinstance(request, MalformedRequest):
            raise request.refusal("GenerateRequest")
        request_limits.check_request(request, self.limits)
        label = convert.label_from_proto(request)
        released = self.live.released(label)
        if released is not None:   # its own last request, perhaps, its client gone a moment ago
            await _wait_for(released, RACE_WAIT_S)
            if not released.is_set() and self.live.ending(label):
                await _wait_for(released, ENDING_WAIT_S)
        try:
            return self.live.claim(label)
        except (DuplicateRequestError, CapacityError, ShuttingDownError) as exc:   # refused before admission: counted too
            if self.metrics is not None:
                self.metrics.request_rejected(_rejected_as(exc))
            raise

    def release(self, identity: RequestIdentity | None) -> None:
        if identity is not None:
            self.live.release(identity)

    async def stream(self, request: pb.GenerateRequest, identity: RequestIdentity, door: str = "grpc",
                     spec: RequestSpec | None = None,
                     trace_context: Mapping[str, str] | None = None) -> AsyncIterator[GenerationEvent]:
        """``door`` names the front door ("grpc", "http") on the request's trace span, which
        continues ``trace_context`` (the client's: ``tracing.client_context``) when given. ``spec``:
        the request already tokenized and validated (``spec``; the HTTP API checks every choice of
        a body before any runs), else done here."""
        span = tracing.start("request", trace_context, door=door, req_id=identity.req_id,
                             label=identity.label)   # None: tracing off
        outcome: FinishReason | str = "unfinished"
        error: BaseException | None = None
        num_tokens = 0
        try:
            try:
                if spec is None:
                    with tracing.child(span, "tokenize"):
                        spec = await self.spec(request, identity.req_id)
            except asyncio.CancelledError:   # the client left while its prompt was tokenized
                self.left_early()
                raise
            if span is not None:
                span.set_attribute("pdserve.prompt_tokens", len(spec.prompt_token_ids))
                spec = dataclasses.replace(spec, traceparent=tracing.traceparent_of(span))
            async with contextlib.aclosing(self._stream(spec, request, span)) as events:
                async for event in events:
                    outcome = event.delta.finish_reason or outcome
                    num_tokens += len(event.delta.token_ids)
                    yield event
        except BaseException as exc:   # refused, failed, cancelled: named on the span
            outcome, error = type(exc).__name__, exc
            raise
        finally:
            if span is not None:
                tracing.end(span, fault_of(error),
                            outcome=getattr(outcome, "value", outcome), completion_tokens=num_tokens)

    async def _stream(self, spec: RequestSpec, request: pb.GenerateRequest, span) -> AsyncIterator[GenerationEvent]:
        trace = RequestTrace()
        stream_span = None
        detok = self._detokenizer(spec)
        trim = StopTextTrimmer(spec.sampling.stop, spec.sampling.include_stop_str_in_output) if spec.sampling.stop else None
        outcome: FinishReason | None = FinishReason.ABORT  # until the stream says otherwise (None: invalid)
        rejected: str | None = None   # refused by admission: the reason it is counted under
        QUEUE_POLICY.set(self._queue_policy)  # read by the request's DeltaQueue
        try:
            async with contextlib.aclosing(self.orchestrator.generate(spec, trace)) as deltas:
                async for delta in deltas:
                    trace.on_tokens(len(delta.token_ids))
                    if delta.finish_reason is FinishReason.ERROR:
                        if delta.error_field:   # its own constraints left it nothing: the client's to fix
                            raise InvalidRequestError(f"sampling.{delta.error_field}", delta.error or "")
                        outcome = FinishReason.ERROR
                        raise RequestFailedError(delta.error or "the worker failed the request")
                    if delta.finished:
                        outcome = delta.finish_reason
                    if stream_span is None and span is not None:   # first token: streaming begins
                        stream_span = tracing.child(span, "stream")
                    event = self._event(delta, detok, trim, spec, trace, self._ended_by_stop_token(delta, spec))
                    if delta.finish_reason is FinishReason.STOP:
                        event = dataclasses.replace(event, stop_reason=self._stop_reason(delta, spec, trim))
                    yield event
        except CapacityError as exc:   # refused by admission (a slow reader is an abort)
            rejected = None if isinstance(exc, SlowReaderError) else _rejected_as(exc)
            raise
        except InvalidRequestError:   # the client's to fix: counted once, as ``invalid``, by ``failure``
            outcome = None
            raise
        except Exception:
            outcome = FinishReason.ERROR
            raise
        finally:
            if outcome is not None:
                self._record(spec, trace, outcome, rejected)
            if stream_span is not None:
                stream_span.set_attribute("pdserve.completion_tokens", len(trace.token_times))
                stream_span.end()

    def failure(self, exc: BaseException, identity: RequestIdentity | None) -> tuple[grpc.StatusCode, str]:
        """The status and message a failed request ends with (``router.errors``), counted."""
        code, message = status_for(exc, identity.req_id if identity else "")
        if self.metrics is not None and code is grpc.StatusCode.INVALID_ARGUMENT:
            self.metrics.request_invalid()
        return code, message

    def left_early(self, num_requests: int = 1) -> None:
        """Requests whose client left before they reached admission: counted as aborts."""
        if self.metrics is not None:
            for _ in range(num_requests):
                self.metrics.request_left_early()

    def server_cancel(self, exc: asyncio.CancelledError) -> SlowReaderError | ShuttingDownError | None:
        """The error to answer when ``exc`` is a cancel of the server's own: its client stopped
        reading (``SLOW_READER``), or the stop cut it (``CUT_AT_STOP``); the task is uncancelled
        so it can answer. None for any other cancel (the client left, a deadline passed)."""
        if exc.args[:1] == (SLOW_READER,):
            error = SlowReaderError(f"max_pending_tokens: the client left more than "
                                    f"{self.limits.max_pending_tokens} tokens unread")
        elif exc.args[:1] == (CUT_AT_STOP,):
            error = ShuttingDownError("the server is shutting down: the request was cut before it finished; "
                                      "retry it on another replica")
        else:
            return None
        asyncio.current_task().uncancel()
        return error

    # ---- pieces -----------------------------------------------------------------------------
    async def spec(self, request: pb.GenerateRequest, req_id: str) -> RequestSpec:
        if self._needs_tokenizer(request):   # tokenizing a long prompt takes a while: off the event loop
            return await self.on_tokenizer_pool(self._tokenized_spec, request, req_id)
        prompt = convert.prompt_from_proto(request, self.tokenizer)
        return convert.spec_from_proto(request, prompt, self.defaults, req_id)

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The token ids ``stream`` would feed the model for this request's prompt (the HTTP API's
        ``/tokenize``): the same size limits and conversion, on the tokenizer pool."""
        request_limits.check_request(request, self.limits)
        if not self._needs_tokenizer(request):
            return convert.prompt_from_proto(request, self.tokenizer)
        return await self.on_tokenizer_pool(convert.prompt_from_proto, request, self.tokenizer)

    async def text_of(self, token_ids: list[int], field: str) -> str:
        """The tokenizer's text for ``token_ids``, special tokens included (``/detokenize``); the ids
        are checked against the vocabulary on the pool too (per-token work)."""
        if self.tokenizer is None:
            raise InvalidRequestError(field, "this model has no tokenizer")
        return await self.on_tokenizer_pool(self._checked_text, token_ids, field)

    async def on_tokenizer_pool(self, fn, *args):
        """``fn(*args)`` on the tokenizer threads: tokenizer work never runs on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _checked_text(self, token_ids: list[int], field: str) -> str:
        check_token_ids(token_ids, self.defaults.vocab_size, field)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _needs_tokenizer(self, request: pb.GenerateRequest) -> bool:
        """A text or chat prompt (checked for one here: malformed messages are named before
        anything else), bad words, or a structured output (its grammar is compiled to be checked:
        milliseconds, not the event loop's); token ids need none."""
        kind = request.WhichOneof("prompt")
        if kind == "chat":
            chat_from_proto(request.chat)
        if kind in ("text", "chat") and self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: send token_ids")
        if request.sampling.bad_words and self.tokenizer is None:
            raise InvalidRequestError("sampling.bad_words", "this model has no tokenizer to turn words into tokens")
        guided = request.sampling.HasField("structured_output")
        if guided and self.tokenizer is None:
            raise InvalidRequestError("sampling.structured_output", "this model has no tokenizer to match a grammar against")
        return kind in ("text", "chat") or bool(request.sampling.bad_words) or guided

    def _tokenized_spec(self, request: pb.GenerateRequest, req_id: str) -> RequestSpec:
        """On the tokenizer pool: tokenize, then validate the ids there too (per-token work)."""
        prompt = convert.prompt_from_proto(request, self.tokenizer)
        bad_words = convert.bad_words_from_proto(request.sampling, self.tokenizer)
        return convert.spec_from_proto(request, prompt, self.defaults, req_id, bad_words)

    def _detokenizer(self, spec: RequestSpec) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, spec.prompt_token_ids,
                                      skip_special_tokens=spec.sampling.skip_special_tokens)

    def _ended_by_stop_token(self, delta: TokenDelta, spec: RequestSpec) -> bool:
        """The delta's last token is the EOS or stop token id that ended the request: its text is
        not output text unless ``include_stop_str_in_output`` (vLLM's rule; the id stays in
        ``token_ids``). Matters where it has text: a non-special stop token, or special tokens kept."""
        if spec.sampling.include_stop_str_in_output:
            return False
        return self._stop_token(delta, spec) is not None

    def _stop_reason(self, delta: TokenDelta, spec: RequestSpec, trim: StopTextTrimmer | None) -> str | int | None:
        """What stopped a request that finished with STOP (the text of its last event already
        pushed through ``trim``): the stop string found, else its last token when that is a stop
        token id; None for EOS (checked first, as the engine does: ``engine/stop.py``)."""
        if trim is not None and trim.matched is not None:
            return trim.matched
        stop = self._stop_token(delta, spec)
        return None if stop is None or stop[1] else stop[0]

    def _stop_token(self, delta: TokenDelta, spec: RequestSpec) -> tuple[int, bool] | None:
        """(the delta's last token, whether it is EOS) when that token ended the request as EOS or a
        stop token id (EOS first, as ``engine/stop.py`` checks); None otherwise."""
        if delta.finish_reason is not FinishReason.STOP or not delta.token_ids:
            return None
        last, sampling = delta.token_ids[-1], spec.sampling
        if not sampling.ignore_eos and last in self.defaults.eos_token_ids:
            return last, True
        return (last, False) if last in sampling.stop_token_ids else None

    @staticmethod
    def _event(delta: TokenDelta, detok, trim: StopTextTrimmer | None, spec: RequestSpec,
               trace: RequestTrace, drop_stop_token: bool = False) -> GenerationEvent:
        text_ids = delta.token_ids[:-1] if drop_stop_token else delta.token_ids
        within_min = spec.sampling.min_tokens - (len(trace.token_times) - len(delta.token_ids))
        text = _text(text_ids, delta.finished, detok, trim, within_min) if detok else ""
        if not delta.finished:
            return GenerationEvent(delta, text)
        usage = Usage(prompt_tokens=len(spec.prompt_token_ids), completion_tokens=len(trace.token_times))
        return GenerationEvent(delta, text, usage, trace.timings())

    def _record(self, spec: RequestSpec, trace: RequestTrace, outcome: FinishReason, rejected: str | None) -> None:
        if self.metrics is None:
            return
        if rejected is not None:
            self.metrics.request_rejected(rejected)
            return
        times = trace.token_times
        itls = [b - a for a, b in zip(times, times[1:])]
        self.metrics.request_finished(
            outcome, trace.timings(), len(spec.prompt_token_ids), len(times), itls,
            spec.slo.ttft_s, spec.slo.tpot_s, transport=trace.transport or None,
        )

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)


def _text(ids, finished: bool, detok: IncrementalDetokenizer, trim: StopTextTrimmer | None, within_min: int) -> str:
    """The output text of ``ids``: a stop string and what follows it are not (``trim``). The
    first ``within_min`` of them are still within min_tokens: a stop string they complete does
    not count, so their text goes to the trimmer apart."""
    if trim is None:
        return detok.push(ids, finished=finished)
    if within_min <= 0:
        return trim.push(detok.push(ids, finished=finished), finished=finished)
    head_ids = ids[:within_min]
    last = within_min >= len(ids)
    # Token by token, as vLLM's detokenizer marks where min_tokens ends in the text: decoded
    # together, a head that ends inside a character would hold its whole text back, and a stop
    # string ending within min_tokens would then be checked with the next tokens' text (found by
    # a probe: the same request's text differed with how its tokens were batched into messages).
    head = ""
    for i, token in enumerate(head_ids):
        ends = finished and last and i == len(head_ids) - 1
        head += trim.push(detok.push([token], finished=ends), finished=ends, checked=False)
    if last:
        return head
    return head + trim.push(detok.push(ids[within_min:], finished=finished), finished=finished)


async def _wait_for(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
