"""Direct prefill submissions (the router's unix socket to a prefill worker on its node), with
real Prefill and Decode workers in one process (tiny random Llama): a submission starts the
request before its (Ray) call comes, the call then joins it, even after the run ended, and gets
its result once; the output equals HF generate. A submission is ignored when the decode peer is
unknown, when an abort for its id came first (a tombstone), or when the run exists already; a
run whose call never comes is gone once aborted. Every test ends with both workers' leak check."""

from __future__ import annotations

import asyncio

from engine.types import FirstToken, HandoffOutcome, PrefillResult, PrefillSubmission, RequestSpec, SamplingParams
from engine.unix_push import UnixPusher
from router.first_token_inbox import FirstTokenInbox
from tests.conftest import hf_greedy
from tests.test_first_token_ahead import GatedPeer, _decoded, _workers
from tests.test_prefix_disagg import InProcessPeer

PROMPT = tuple(range(50, 83))
MAX_NEW = 5


def _spec(req_id: str, max_tokens: int = MAX_NEW) -> RequestSpec:
    return RequestSpec(req_id, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _setup(peer_cls=InProcessPeer, **kw):
    prefill, decode = _workers()
    await prefill.open_submissions()
    peer = prefill.known_peer(peer_cls(decode, **kw))   # as the Ray call's DecodePeer is remembered
    inbox = FirstTokenInbox()
    await inbox.start()
    return prefill, decode, peer, inbox, UnixPusher()


async def _teardown(prefill, decode, inbox, pusher) -> tuple[dict, dict]:
    reports = await prefill.leak_report(), await decode.leak_report()
    pusher.close()
    prefill.shutdown()
    decode.shutdown()
    await inbox.close()
    return reports


def _submit(pusher, prefill, spec, inbox, decode_id: str = InProcessPeer.peer_id) -> None:
    sub = PrefillSubmission(spec, "shm", decode_id, inbox.path)
    assert pusher.push(prefill.submissions.path, sub.to_json())


def _clean(reports) -> None:
    for report in reports:
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]


def test_a_submission_starts_the_request_and_the_call_joins_it_after_it_ended(hf_reference):
    spec = _spec("d0")

    async def run():
        prefill, decode, peer, inbox, pusher = await _setup(GatedPeer, gate=asyncio.Event())
        try:
            stream = decode.stream()
            early = inbox.expect(spec.req_id)
            _submit(pusher, prefill, spec, inbox)
            first = await asyncio.wait_for(early, 60)   # no call made: the socket started it
            assert isinstance(first, FirstToken) and not peer.committed
            peer.gate.set()
            await asyncio.wait_for(prefill._running[spec.req_id].result, 60)   # the run ended, unjoined
            items = [item async for item in prefill.stream(spec, "shm", peer, inbox.path)]   # the call, late
            assert spec.req_id not in prefill._running   # joined: gone; a retry would start it anew
            tokens = await _decoded(stream, spec.req_id, [first.token_id], MAX_NEW)
            inbox.forget(spec.req_id)
            return items, tokens, await _teardown(prefill, decode, inbox, pusher)
        finally:
            prefill.shutdown()
            decode.shutdown()

    items, tokens, reports = asyncio.run(run())
    assert len(items) == 1 and isinstance(items[0], PrefillResult) and items[0].outcome is HandoffOutcome.OK
    assert tokens == hf_greedy(hf_reference, list(PROMPT), MAX_NEW)
    _clean(reports)


def test_submissions_that_must_not_start_a_request_are_ignored():
    """Unknown decode peer; an id aborted before its submission came; an id running already."""

    async def run():
        # The call's run cannot end before the submissions are read: its commit waits for the gate
        # (the marker ends at prefill and needs none). On a busy machine it once had.
        prefill, decode, peer, inbox, pusher = await _setup(GatedPeer, gate=asyncio.Event())
        try:
            stream = decode.stream()
            await prefill.abort("aborted-first")   # not here: leaves a tombstone
            running = prefill.stream(_spec("running"), "shm", peer, inbox.path)
            first_item = asyncio.ensure_future(running.__anext__())
            await asyncio.sleep(0)   # the call has started it
            run_of_call = prefill._running["running"]
            _submit(pusher, prefill, _spec("unknown-peer"), inbox, decode_id="no-such-decode-worker")
            _submit(pusher, prefill, _spec("aborted-first"), inbox)
            _submit(pusher, prefill, _spec("running"), inbox)
            marker = inbox.expect("marker")   # one connection, read in order: the others came first
            _submit(pusher, prefill, _spec("marker", max_tokens=1), inbox)
            await _until(lambda: "marker" in prefill._running)
            started = set(prefill._running)
            assert prefill._running["running"] is run_of_call
            peer.gate.set()
            results = [await asyncio.wait_for(first_item, 60)] + [item async for item in running]
            await _decoded(stream, "running", [results[-1].first_token_id], MAX_NEW)   # to its end
            marker_result = [item async for item in prefill.stream(_spec("marker", 1), "shm", peer, inbox.path)]
            await decode.abort("marker")   # its unused reservation (ended at prefill), as the router frees it
            went_ahead = marker.done()
            inbox.forget("marker")
            return started, results, marker_result, went_ahead, await _teardown(prefill, decode, inbox, pusher)
        finally:
            prefill.shutdown()
            decode.shutdown()

    started, results, marker_result, went_ahead, reports = asyncio.run(run())
    assert started == {"running", "marker"}
    assert results[-1].outcome is HandoffOutcome.OK
    assert marker_result[-1].outcome is HandoffOutcome.ENDED_AT_PREFILL and not went_ahead
    _clean(reports)


def test_a_run_whose_call_never_comes_is_gone_once_aborted():
    """The router gave up between its submission and its Ray call: its abort stops the run and
    frees everything; the run does not linger for a call that will not come."""
    spec = _spec("orphan")

    async def run():
        prefill, decode, peer, inbox, pusher = await _setup(GatedPeer, gate=asyncio.Event())
        try:
            early = inbox.expect(spec.req_id)
            _submit(pusher, prefill, spec, inbox)
            await asyncio.wait_for(early, 60)   # it runs: the first token went out, the hand-off is held
            abort = asyncio.ensure_future(prefill.abort(spec.req_id))
            peer.gate.set()   # the commit it was in finishes; nothing new starts
            await asyncio.wait_for(abort, 60)
            assert spec.req_id not in prefill._running
            await decode.abort(spec.req_id)   # the router's decode-side abort follows
            inbox.forget(spec.req_id)
            return await _teardown(prefill, decode, inbox, pusher)
        finally:
            prefill.shutdown()
            decode.shutdown()

    _clean(asyncio.run(run()))


async def _until(condition, timeout_s: float = 60.0) -> None:
    """Wait for ``condition()`` (the worker's event loop is this one: each pass lets it run)."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)
