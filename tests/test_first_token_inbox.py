"""The router's first-token inbox (a direct channel from prefill workers on its node): a pushed
FirstToken arrives whole; ``first_ahead`` takes whichever copy of the first token comes first
(inbox or Ray stream), drops the other, and passes the stream's other items and errors on."""

from __future__ import annotations

import asyncio

import pytest

from engine.types import FirstToken, PrefillResult, PromptLogprobs
from engine.unix_push import UnixPusher
from router.first_token_inbox import FirstTokenInbox, first_ahead

FIRST = FirstToken("r0", 42, -0.5, ((42, -0.5), (7, -1.25)), received_s=1.0, sent_s=2.0, queue_s=0.1,
                   prefill_s=0.5, reserve_wait_s=0.01,
                   prompt_logprobs=PromptLogprobs((5, 3, 4), (-1.5, -0.25), (2, 1),
                                                  (((9, -0.5), (3, -1.5)), ((4, -0.25), (8, -2.0)))))
RESULT = PrefillResult("r0", 42)


def test_a_pushed_first_token_arrives_whole():
    async def run():
        inbox = FirstTokenInbox()
        path = await inbox.start()
        pusher = UnixPusher()
        try:
            early = inbox.expect("r0")
            assert pusher.push(path, FIRST.to_json())
            got = await asyncio.wait_for(early, 10)
            other = inbox.expect("r1")   # the connection stays open: the next push writes at once
            assert pusher.push(path, FirstToken("r1", 3).to_json())
            stray = FirstToken("nobody-waits", 5)
            assert pusher.push(path, stray.to_json())   # dropped: nobody expects it
            return got, await asyncio.wait_for(other, 10)
        finally:
            pusher.close()
            inbox.forget("r0")
            inbox.forget("r1")
            await inbox.close()

    got, other = asyncio.run(run())
    assert got == FIRST and other == FirstToken("r1", 3)


def test_a_push_to_a_closed_inbox_says_it_did_not_go_out():
    """The router's side of the connection gone (its inbox closed), or no inbox at the path:
    ``push`` is False (the worker then sends the token on its Ray stream), and it reconnects to
    an inbox that is back."""
    async def run():
        inbox = FirstTokenInbox()
        path = await inbox.start()
        pusher = UnixPusher()
        try:
            assert pusher.push(path, FIRST.to_json())
            await inbox.close()   # closes the connection under the pusher
            await asyncio.sleep(0.05)   # the close reaches the socket
            line = FIRST.to_json()
            went = [pusher.push(path, line), pusher.push(path, line)]   # on the broken one, then to no inbox
            again = FirstTokenInbox()
            again_path = await again.start()
            early = again.expect("r0")
            went.append(pusher.push(again_path, FIRST.to_json()))
            got = await asyncio.wait_for(early, 10)
            again.forget("r0")
            await again.close()
            return went, got
        finally:
            pusher.close()

    went, got = asyncio.run(run())
    assert went == [False, False, True] and got == FIRST


async def _stream(items, gate: asyncio.Event | None = None, error: Exception | None = None):
    for i, item in enumerate(items):
        if i == 0 and gate is not None:
            await gate.wait()   # the stream's first item comes late
        yield item
    if error is not None:
        raise error


@pytest.mark.parametrize("inbox_first", [True, False])
def test_whichever_copy_comes_first_is_used_once(inbox_first):
    async def run():
        early = asyncio.get_running_loop().create_future()
        gate = asyncio.Event()   # holds the stream's first item back
        if inbox_first:
            early.set_result(FIRST)
        else:
            gate.set()
        out = []
        async for item in first_ahead(_stream([FIRST, RESULT], gate), early):
            out.append(item)
            gate.set()   # the stream's copy follows (and is dropped when the inbox's went first)
        return out

    assert asyncio.run(run()) == [FIRST, RESULT]


def test_errors_and_closing_pass_through():
    async def run():
        early = asyncio.get_running_loop().create_future()
        early.set_result(FIRST)
        seen = []
        with pytest.raises(RuntimeError, match="worker lost"):   # after the inbox's first token
            async for item in first_ahead(_stream([], None, RuntimeError("worker lost")), early):
                seen.append(item)
        stuck = first_ahead(_stream([FIRST], asyncio.Event()), early)
        assert await anext(stuck) == FIRST
        await stuck.aclose()   # the consumer leaves while the stream's next item is pending
        never = asyncio.get_running_loop().create_future()
        plain = [item async for item in first_ahead(_stream([FIRST, RESULT]), never)]
        passthrough = [item async for item in first_ahead(_stream([FIRST, RESULT]), None)]
        return seen, plain, passthrough

    seen, plain, passthrough = asyncio.run(run())
    assert seen == [FIRST] and plain == [FIRST, RESULT] and passthrough == [FIRST, RESULT]


async def _ends_when_cancelled():
    """A stream that ends (rather than raising CancelledError) when its pending read is
    cancelled, as a Ray streaming call's can: that read's task finishes with StopAsyncIteration."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        return
    yield FIRST


@pytest.mark.parametrize("case", ["stream ends as it is cancelled", "stream failed unread"])
def test_a_consumer_that_leaves_leaves_no_unretrieved_task_error(case):
    """A client's deadline or disconnect closes ``first_ahead`` while the stream's read is pending
    or already over; whatever that read ended with is nobody's to handle, and must not reach the
    loop's handler as "Task exception was never retrieved" (an ERROR line per cancelled request
    in a deadline storm)."""
    import gc

    async def run():
        reported = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        early = asyncio.get_running_loop().create_future()
        if case == "stream ends as it is cancelled":
            items = first_ahead(_ends_when_cancelled(), early)
            reader = asyncio.ensure_future(anext(items))
            await asyncio.sleep(0.01)
            reader.cancel()   # the client's deadline
            with pytest.raises(asyncio.CancelledError):
                await reader
        else:
            early.set_result(FIRST)   # the inbox's copy, and the stream's failure, in one wait
            items = first_ahead(_stream([], None, RuntimeError("worker lost")), early)
            await asyncio.sleep(0)
            assert await anext(items) == FIRST
        await items.aclose()
        del items
        gc.collect()
        await asyncio.sleep(0)
        return reported

    reported = asyncio.run(run())
    assert not reported, [c.get("message") for c in reported]


def test_first_ahead_closed_after_the_stream_ended_leaves_no_unretrieved_error():
    """The inbox's first token and the stream's end land together; the consumer closes after the
    first token (a client that cancels): the stream's finished read (StopAsyncIteration, or an
    error) is retrieved, not left for asyncio to log as 'Task exception was never retrieved'."""
    import gc

    errors = []

    async def items():
        if False:
            yield None   # an empty stream: its first read ends it

    async def run():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx["message"]))
        early = asyncio.get_running_loop().create_future()
        early.set_result(FirstToken("r", 5, None, None))
        stream = first_ahead(items(), early)
        await asyncio.sleep(0)   # nothing runs yet: an async generator starts on its first read
        first = await anext(stream)
        await asyncio.sleep(0.01)   # the stream's read ends meanwhile
        await stream.aclose()
        gc.collect()
        await asyncio.sleep(0)
        return first

    assert asyncio.run(run()).token_id == 5
    gc.collect()
    assert errors == []
