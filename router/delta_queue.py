"""One request's queue of token deltas between its decode worker's stream and its gRPC stream:
it sets how many tokens one message carries, and bounds what a reader that falls behind leaves.

grpc.aio's write blocks while the client's flow-control window is full, so a client that stops
reading stops the handler from taking deltas, and they pile up here. The rules:
  merge    - ``get`` returns every delta pending, merged into one (one message instead of many);
  interval - ``get`` waits until ``stream_interval`` tokens are pending (vLLM's and SGLang's
             ``--stream-interval``), unless the stream finished, failed, or has not started (its
             first tokens go at once: TTFT never waits for an interval). The handler is woken
             only then, so a larger interval costs the router one wake-up, one message and one
             write per ``stream_interval`` tokens instead of per token; 1 sends every step's token
             as it comes (a reader that lags still gets what piled up as one message);
  cancel   - past ``max_pending_tokens`` pending, the deltas are dropped, the queue yields only a
             ``SlowReaderError``, and the task that consumes it (the request's handler, blocked in
             its write) is cancelled with ``SLOW_READER``: the handler aborts the request (its KV is
             freed) and answers RESOURCE_EXHAUSTED.
Both numbers are the server's options (``ServerLimits``), per request: the handler sets
``QUEUE_POLICY`` (a context variable) before the queue is made in its task, so ``DecodeStreams``
makes the queue without knowing the server's options.

Life cycle: made by ``DecodeStreams.register`` inside the request's handler task; ``put_nowait``
from the stream demux; ``get`` by the orchestrator (in that same task), which calls ``started``
when the first token reached the client another way (the prefill worker's); dropped on
unregister.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from dataclasses import dataclass

from engine.errors import CapacityError
from engine.types import FinishReason, TokenDelta

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class QueuePolicy:
    max_pending_tokens: int = 4096
    stream_interval: int = 1


QUEUE_POLICY: contextvars.ContextVar[QueuePolicy] = contextvars.ContextVar("queue_policy", default=QueuePolicy())
SLOW_READER = "pdserve: slow reader"   # the cancel message the handler recognises

QueueItem = TokenDelta | Exception


class SlowReaderError(CapacityError):
    """The client did not read its stream: ``max_pending_tokens`` tokens waited for it."""


class DeltaQueue:
    def __init__(self, max_pending_tokens: int | None = None, stream_interval: int | None = None) -> None:
        policy = QUEUE_POLICY.get()
        self.max_pending_tokens = policy.max_pending_tokens if max_pending_tokens is None else max_pending_tokens
        self.stream_interval = policy.stream_interval if stream_interval is None else stream_interval
        # A delta, a run of deltas merged as they came (one message's worth), or an error; a new
        # delta joins the run before it unless that one finished.
        self._items: deque[TokenDelta | _Run | Exception] = deque()
        self._num_tokens = 0
        self._release = False     # a finished delta or an error is queued: the reader takes it now
        self._started = False     # the client has had tokens: later ones wait for the interval
        # The reader's wake-up: a bare future per wait (an asyncio.Event costs a loop lookup and
        # a waiter list per wait; this runs once per message of every stream).
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self._consumer = asyncio.current_task()   # the handler's task (None outside a task)
        self.overflowed = False

    @property
    def num_pending_tokens(self) -> int:
        return self._num_tokens

    def started(self) -> None:
        """The stream's first tokens reached the client another way: the next wait for the interval."""
        self._started = True

    def put_nowait(self, item: QueueItem) -> None:
        if self.overflowed:
            return
        if isinstance(item, TokenDelta):
            self._put_delta(item)
            self._num_tokens += len(item.token_ids)
            if self._num_tokens > self.max_pending_tokens:
                self._overflow()
                return
            if item.finish_reason is not None:
                self._release = True
        else:
            self._items.append(item)
            self._release = True
        if self._is_ready():
            self._wake()   # one wake-up per message, not per token

    def _put_delta(self, delta: TokenDelta) -> None:
        last = self._items[-1] if self._items else None
        if type(last) is _Run and last.finish_reason is None:
            last.add(delta)
        elif type(last) is TokenDelta and last.finish_reason is None:
            self._items[-1] = _Run(last, delta)
        else:
            self._items.append(delta)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> QueueItem:
        while not self._is_ready():
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> QueueItem:
        item = self._items.popleft()
        if isinstance(item, Exception):
            self._release = bool(self._items) and self._has_release()
            return item
        delta = item.delta() if type(item) is _Run else item
        self._num_tokens -= len(delta.token_ids)
        self._started = self._started or bool(delta.token_ids)
        self._release = bool(self._items) and self._has_release()
        return delta

    def _has_release(self) -> bool:
        """What is left holds a finished delta or an error (rare: only past a finished delta or an error)."""
        return any(isinstance(i, Exception) or i.finish_reason is not None for i in self._items)

    def _is_ready(self) -> bool:
        return self._release or (self._num_tokens >= self.stream_interval or not self._started) and bool(self._items)

    def _overflow(self) -> None:
        logger.warning("a stream's reader is %d tokens behind (max_pending_tokens %d): cancelling it",
                       self._num_tokens, self.max_pending_tokens)
        self.overflowed = True
        self._items.clear()
        self._num_tokens = 0
        self._items.append(SlowReaderError(
            f"max_pending_tokens: the client left more than {self.max_pending_tokens} tokens unread"))
        self._release = True
        self._wake()
        if self._consumer is not None and not self._consumer.done():
            self._consumer.cancel(SLOW_READER)


class _Run:
    """Consecutive deltas of one request being merged into one (only the last may finish): the
    token ids (and logprobs) appended as each delta comes, so a message of k tokens costs O(k)."""

    __slots__ = ("req_id", "token_ids", "finish_reason", "logprobs", "error", "error_field", "num_cached_tokens",
                 "top_logprobs", "prompt_logprobs")

    def __init__(self, *deltas: TokenDelta) -> None:
        first = deltas[0]
        self.req_id, self.num_cached_tokens = first.req_id, first.num_cached_tokens
        self.prompt_logprobs = first.prompt_logprobs   # only a request's first delta has them
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[float] | None = None        # None until a delta carries some
        self.top_logprobs: list | None = None
        self.error: str | None = None
        self.error_field: str | None = None
        for delta in deltas:
            self.add(delta)

    def add(self, delta: TokenDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.finish_reason = delta.finish_reason
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(delta.top_logprobs)
        if delta.error:
            self.error, self.error_field = delta.error, delta.error_field

    def delta(self) -> TokenDelta:
        return TokenDelta(self.req_id, tuple(self.token_ids), self.finish_reason,
                          None if self.logprobs is None else tuple(self.logprobs), self.error,
                          self.num_cached_tokens,
                          top_logprobs=None if self.top_logprobs is None else tuple(self.top_logprobs),
                          prompt_logprobs=self.prompt_logprobs, error_field=self.error_field)


def merge(*deltas: TokenDelta) -> TokenDelta:
    """Consecutive deltas of one request as one (only the last may finish)."""
    return deltas[0] if len(deltas) == 1 else _Run(*deltas).delta()
