"""The router's inbox for first tokens: a direct channel from the prefill workers on its node.

A Ray actor call's reply (the prefill call's streamed ``FirstToken``) costs a Ray round trip's
second half on the first token's path; a write on a unix socket costs a tenth of it (measured:
benchmarks/results/disagg_overhead.txt). So a prefill worker on this node writes each first
token here, as one JSON line, the moment it may go to the client, and leaves it off its Ray
stream when that write went out (one channel: a second copy, even one dropped unread, costs
this loop its delivery just as it writes the first token to the client). The Ray stream stays
the source of truth (its result carries the token; failures, retries, workers on other nodes);
should both copies come, whichever arrives first is used and the other dropped
(``first_ahead``); a lost line costs only the speed-up.

Life cycle: ``start`` (a unix server in the router's event loop, in a private directory;
``engine.unix_listen``) ->
per request ``expect(req_id)`` (a future the line resolves) ... ``forget(req_id)`` (always) ->
``close`` (server and its connections down, so a worker's next write fails and goes by Ray;
socket and directory removed). One owner: the orchestrator's requests.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from engine.types import FirstToken
from engine.unix_listen import UnixLineServer

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 1 << 20   # a first token with 20 top logprobs is ~1 KB


class FirstTokenInbox:
    def __init__(self) -> None:
        self._listener = UnixLineServer("pdserve-inbox-", "first-tokens.sock", self._deliver, MAX_LINE_BYTES)
        self._waiting: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        """First tokens awaited now (each a request between dispatch and its first token)."""
        return len(self._waiting)

    @property
    def path(self) -> str | None:
        return self._listener.path

    async def start(self) -> str:
        return await self._listener.start()

    def expect(self, req_id: str) -> asyncio.Future:
        future = self._waiting[req_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, req_id: str) -> None:
        future = self._waiting.pop(req_id, None)
        if future is not None and not future.done():
            future.cancel()

    def _deliver(self, line: bytes) -> None:
        try:
            first = FirstToken.from_json(line)
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("first-token inbox: unreadable line dropped: %s", exc)
            return
        future = self._waiting.get(first.req_id)
        if future is not None and not future.done():
            future.set_result(first)

    async def close(self) -> None:
        self._listener.close()
        await self._listener.wait_closed()
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()


async def first_ahead(items: AsyncIterator[Any], early: asyncio.Future | None) -> AsyncIterator[Any]:
    """The prefill call's ``items``, with its ``FirstToken`` taken from ``early`` (the inbox's
    future) when that resolves first; the stream's own copy then is dropped. Errors and the end
    of the stream pass through unchanged."""
    if early is None:
        async for item in items:
            yield item
        return
    sent_first = False
    pending = asyncio.ensure_future(anext(items))
    try:
        while True:
            waits = {pending} if sent_first or early.cancelled() else {pending, early}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if early in done and not sent_first and not early.cancelled():   # the inbox's copy is here
                sent_first = True
                yield early.result()
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = asyncio.ensure_future(anext(items))
            if isinstance(item, FirstToken):
                if sent_first:
                    continue
                sent_first = True
            yield item
    finally:
        if not pending.done():   # the stream must be idle before its owner closes it
            pending.cancel()
            await asyncio.wait([pending])
        if not pending.cancelled():   # a read that ended (or failed) unseen: closed, not an error
            pending.exception()
