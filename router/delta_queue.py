"""One request's queue of token deltas between its decode worker's stream and its gRPC stream,
bounded for a reader that falls behind.

grpc.aio's write blocks while the client's flow-control window is full, so a client that stops
reading stops the handler from taking deltas, and they pile up here. Two rules bound that:
  merge  - ``get`` returns every delta pending, merged into one (one message instead of many);
  cancel - past ``max_pending_tokens`` pending, the deltas are dropped, the queue yields only a
           ``SlowReaderError``, and the task that consumes it (the request's handler, blocked in
           its write) is cancelled with ``SLOW_READER``: the handler aborts the request (its KV is
           freed) and answers RESOURCE_EXHAUSTED.
The limit is the server's option, per request: the handler sets ``MAX_PENDING_TOKENS`` (a
context variable) before the queue is made in its task, so ``DecodeStreams`` makes the queue
without knowing the server's options.

Life cycle: made by ``DecodeStreams.register`` inside the request's handler task; ``put_nowait``
from the stream demux; ``get`` by the orchestrator (in that same task); dropped on unregister.
"""

from __future__ import annotations

import asyncio
import itertools
import contextvars
import logging
from collections import deque

from engine.errors import CapacityError
from engine.types import TokenDelta

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_TOKENS = 4096
MAX_PENDING_TOKENS: contextvars.ContextVar[int] = contextvars.ContextVar("max_pending_tokens",
                                                                           default=DEFAULT_MAX_PENDING_TOKENS)
SLOW_READER = "pdserve: slow reader"   # the cancel message the handler recognises

QueueItem = TokenDelta | Exception


class SlowReaderError(CapacityError):
    """The client did not read its stream: ``max_pending_tokens`` tokens waited for it."""


class DeltaQueue:
    def __init__(self, max_pending_tokens: int | None = None) -> None:
        self.max_pending_tokens = MAX_PENDING_TOKENS.get() if max_pending_tokens is None else max_pending_tokens
        self._items: deque[QueueItem] = deque()
        self._num_tokens = 0
        self._ready = asyncio.Event()
        self._consumer = asyncio.current_task()   # the handler's task (None outside a task)
        self.overflowed = False

    @property
    def num_pending_tokens(self) -> int:
        return self._num_tokens

    def put_nowait(self, item: QueueItem) -> None:
        if self.overflowed:
            return
        self._items.append(item)
        self._ready.set()
        if isinstance(item, TokenDelta):
            self._num_tokens += len(item.token_ids)
            if self._num_tokens > self.max_pending_tokens:
                self._overflow()

    async def get(self) -> QueueItem:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._take()

    def _take(self) -> QueueItem:
        if isinstance(self._items[0], Exception):
            return self._items.popleft()
        run = [self._items.popleft()]   # one pass: merging two at a time would copy O(k^2) tokens
        while self._items and isinstance(self._items[0], TokenDelta) and not run[-1].finished:
            run.append(self._items.popleft())
        merged = merge(*run)
        self._num_tokens -= len(merged.token_ids)
        return merged

    def _overflow(self) -> None:
        logger.warning("a stream's reader is %d tokens behind (max_pending_tokens %d): cancelling it",
                       self._num_tokens, self.max_pending_tokens)
        self.overflowed = True
        self._items.clear()
        self._num_tokens = 0
        self._items.append(SlowReaderError(
            f"max_pending_tokens: the client left more than {self.max_pending_tokens} tokens unread"))
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
