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
import itertools
import logging
from collections import deque
from dataclasses import dataclass

from engine.errors import CapacityError
from engine.types import TokenDelta

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
        self._items: deque[QueueItem] = deque()
        self._num_tokens = 0
        self._release = False     # a finished delta or an error is queued: the reader takes it now
        self._started = False     # the client has had tokens: later ones wait for the interval
        self._ready = asyncio.Event()
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
        self._items.append(item)
        if isinstance(item, TokenDelta):
            self._num_tokens += len(item.token_ids)
            if self._num_tokens > self.max_pending_tokens:
                self._overflow()
                return
            if item.finish_reason is not None:
                self._release = True
        else:
            self._release = True
        if self._is_ready():
            self._ready.set()   # wakes the reader (one wake-up per message, not per token)

    async def get(self) -> QueueItem:
        while not self._is_ready():
            self._ready.clear()
            await self._ready.wait()
        return self._take()

    def _take(self) -> QueueItem:
        if isinstance(self._items[0], Exception):
            error = self._items.popleft()
            self._release = bool(self._items) and self._has_release()
            return error
        run = [self._items.popleft()]   # one pass: merging two at a time would copy O(k^2) tokens
        while self._items and isinstance(self._items[0], TokenDelta) and run[-1].finish_reason is None:
            run.append(self._items.popleft())
        merged = merge(*run)
        self._num_tokens -= len(merged.token_ids)
        self._started = self._started or bool(merged.token_ids)
        self._release = bool(self._items) and self._has_release()
        return merged

    def _has_release(self) -> bool:
        """What is left holds a finished delta or an error (rare: only past a finished delta or an error)."""
        return any(not isinstance(i, TokenDelta) or i.finish_reason is not None for i in self._items)

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
        self._ready.set()
        if self._consumer is not None and not self._consumer.done():
            self._consumer.cancel(SLOW_READER)


def merge(*deltas: TokenDelta) -> TokenDelta:
    """Consecutive deltas of one request as one (only the last may finish)."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    error = next((d.error for d in reversed(deltas) if d.error), None)
    return TokenDelta(first.req_id, tuple(itertools.chain.from_iterable(d.token_ids for d in deltas)),
                      last.finish_reason, _joined(d.logprobs for d in deltas), error, first.num_cached_tokens,
                      top_logprobs=_joined(d.top_logprobs for d in deltas))


def _joined(parts) -> tuple | None:
    """Per-token lists of consecutive deltas as one; None when none of them had one."""
    parts = list(parts)
    if all(p is None for p in parts):
        return None
    return tuple(itertools.chain.from_iterable(p or () for p in parts))
