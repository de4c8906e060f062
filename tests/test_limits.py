"""Every request limit at its value and just past it (router/limits.py): INVALID_ARGUMENT or
RESOURCE_EXHAUSTED with a message naming the field; SLO hints clamped; priority only under the
priority policy and in range; the admission queue cap and its bounded FIFO wake-up; the limits
reported in ServerInfo. Cluster tests end with the cluster-wide leak check."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.error
import urllib.request

import grpc
import pytest

from engine.errors import CapacityError, InvalidRequestError
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.client import AsyncPdserveClient, PdserveClient, build_request
from router.convert import ServerDefaults, spec_from_proto
from router.limits import SchedulingPolicy, ServerLimits
from router.wakeup import FairWakeup
from tests.conftest import ByteTokenizer, cluster_leaks
from tests.test_admission import cluster as admission_cluster, sent_to_decode, spec as admission_spec
from tests.test_cluster_e2e import address, start_cluster

LIMITS = ServerLimits(max_stop_strings=3, max_stop_string_chars=8, max_stop_token_ids=4, max_prompt_bytes=200,
                      max_chat_messages=4, max_receive_message_bytes=4096, max_concurrent_streams=4)


@pytest.fixture(scope="module")
def limited(ray_session):
    cluster = start_cluster("disaggregated", defaults={"limits": LIMITS}, http_port=0)
    cluster.cluster.servicer.tokenizer = ByteTokenizer()
    yield cluster
    cluster.stop()


def _status(cluster, **kwargs) -> grpc.StatusCode | None:
    kwargs.setdefault("max_tokens", 2)
    with PdserveClient(address(cluster)) as client:
        try:
            client.generate_text(**kwargs)
            return None
        except grpc.RpcError as exc:
            _status.details = exc.details()
            return exc.code()


_TOOLS = [{"type": "function", "function": {"name": "f"}}]
AT_AND_PAST = [
    # (limit, request at the limit, request just past it, field named)
    ("max_stop_strings", dict(stop=["a", "b", "c"]), dict(stop=["a", "b", "c", "d"]), "sampling.stop"),
    ("max_stop_string_chars", dict(stop=["x" * 8]), dict(stop=["ok", "x" * 9]), "sampling.stop[1]"),
    ("max_stop_strings (bad words)", dict(bad_words=["a", "b", "c"]), dict(bad_words=["a", "b", "c", "d"]),
     "sampling.bad_words"),
    ("max_stop_string_chars (bad words)", dict(bad_words=["x" * 8]), dict(bad_words=["ok", "x" * 9]),
     "sampling.bad_words[1]"),
    ("max_stop_token_ids", dict(stop_token_ids=[1, 2, 3, 4]), dict(stop_token_ids=[1, 2, 3, 4, 5]),
     "sampling.stop_token_ids"),
    ("max_prompt_bytes", dict(text="é" * 100), dict(text="é" * 100 + "a"), "text"),
    ("max_prompt_bytes (chat)", dict(chat=[("user", "x" * 150), ("assistant", "y" * 50)]),
     dict(chat=[("user", "x" * 150), ("assistant", "y" * 51)]), "chat"),
    # a chat's tools count too (the template renders them into the prompt)
    ("max_prompt_bytes (chat with tools)", dict(chat=[("user", "x" * (200 - len(json.dumps(_TOOLS))))], tools=_TOOLS),
     dict(chat=[("user", "x" * (201 - len(json.dumps(_TOOLS))))], tools=_TOOLS), "chat"),
    ("max_chat_messages", dict(chat=[("user", "a"), ("assistant", "b")] * 2),
     dict(chat=[("user", "a"), ("assistant", "b")] * 2 + [("user", "c")]), "chat.messages"),
]


@pytest.mark.parametrize("at, past, field", [c[1:] for c in AT_AND_PAST], ids=[c[0] for c in AT_AND_PAST])
def test_limit_at_value_served_and_past_it_invalid(limited, at, past, field):
    prompt = {} if {"text", "chat"} & set(at) else {"token_ids": [5, 6, 7]}
    assert _status(limited, **prompt, **at) is None
    assert _status(limited, **prompt, **past) is grpc.StatusCode.INVALID_ARGUMENT
    assert _status.details.startswith(f"{field}: "), _status.details
    assert cluster_leaks(limited) == {}


def _text_request_of_size(size: int) -> pb.GenerateRequest:
    req = build_request(text="x")
    req.text = "x" * (size - req.ByteSize() + 1)
    while req.ByteSize() > size:   # the length prefix grew a byte
        req.text = req.text[:-1]
    assert req.ByteSize() == size
    return req


def test_max_receive_message_bytes(limited):
    with grpc.insecure_channel(address(limited)) as channel:
        stub = pb_grpc.PdserveStub(channel)
        with pytest.raises(grpc.RpcError) as at:   # received; refused by the (smaller) prompt-bytes limit
            list(stub.Generate(_text_request_of_size(LIMITS.max_receive_message_bytes), timeout=30))
        with pytest.raises(grpc.RpcError) as past:
            list(stub.Generate(_text_request_of_size(LIMITS.max_receive_message_bytes + 1), timeout=30))
    assert at.value.code() is grpc.StatusCode.INVALID_ARGUMENT and at.value.details().startswith("text: ")
    assert past.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def _refusals(cluster, reason: str) -> float:
    registry = cluster.cluster.metrics.registry
    return (registry.get_sample_value("pdserve_admission_decisions_total", {"decision": "reject", "reason": reason}) or 0.0,
            registry.get_sample_value("pdserve_requests_total", {"outcome": "rejected"}) or 0.0)


def test_max_concurrent_streams(limited):
    before = _refusals(limited, "max_streams")

    async def scenario():
        async with AsyncPdserveClient(address(limited)) as client:
            streams = [client.generate(token_ids=[9, 10, i + 3], max_tokens=400, ignore_eos=True)
                       for i in range(LIMITS.max_concurrent_streams)]
            for s in streams:   # all four live
                await s.__anext__()
            with pytest.raises(grpc.RpcError) as past:
                await client.generate_text(token_ids=[5], max_tokens=1)
            await streams[0].aclose()    # one ends: room for one more
            await asyncio.sleep(0.2)
            served = await client.generate_text(token_ids=[5], max_tokens=1)
            for s in streams[1:]:
                await s.aclose()
            return past.value, served

    past, served = asyncio.run(scenario())
    assert past.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent_streams" in past.details()
    assert ("grpc-retry-pushback-ms", "1000") in tuple(past.trailing_metadata()), past.trailing_metadata()
    assert served.usage.completion_tokens == 1
    assert _refusals(limited, "max_streams") == (before[0] + 1, before[1] + 1), "the refusal is counted"
    assert cluster_leaks(limited) == {}


def test_a_completions_batch_is_live_requests_counted_against_max_concurrent_streams(limited):
    """Overload by one body: a batch of prompts x n is that many live requests. Within
    max_concurrent_streams (4) it is served; past it the whole body is a 429 naming the limit,
    nothing of it runs, and nothing is held (leak check)."""
    url = f"http://127.0.0.1:{limited.cluster.http_port}/v1/completions"

    def post(body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    status, body = post({"prompt": [[5, 6], [7, 8]], "n": 2, "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    status, body = post({"prompt": [[5, 6], [7, 8], [9]], "n": 2, "max_tokens": 2, "ignore_eos": True})
    assert status == 429 and "max_concurrent_streams" in body["error"]["message"], body
    assert cluster_leaks(limited) == {}


def test_server_info_reports_limits(limited):
    with PdserveClient(address(limited)) as client:
        limits = client.server_info().limits
    assert (limits.max_stop_strings, limits.max_stop_string_chars, limits.max_stop_token_ids) == (3, 8, 4)
    assert (limits.max_prompt_bytes, limits.max_chat_messages, limits.max_receive_message_bytes) == (200, 4, 4096)
    assert limits.max_concurrent_streams == 4 and limits.max_queued_requests == LIMITS.max_queued_requests
    assert limits.max_pending_tokens == LIMITS.max_pending_tokens
    assert limits.max_structured_output_chars == LIMITS.max_structured_output_chars == 65_536
    assert (limits.ttft_ms_range.min, limits.ttft_ms_range.max) == (LIMITS.min_ttft_ms, LIMITS.max_ttft_ms)
    assert limits.scheduling_policy == pb.SCHEDULING_POLICY_FCFS


# ---------------------------------------------------------------- unit level: clamps, priority

DEFAULTS = ServerDefaults(max_model_len=64, vocab_size=100, max_tokens=4)


def _spec(limits: ServerLimits = ServerLimits(), **kwargs):
    req = build_request(token_ids=[1, 2], **kwargs)
    return spec_from_proto(req, [1, 2], dataclasses.replace(DEFAULTS, limits=limits), "r")


def test_slo_hints_clamped_into_range():
    lim = ServerLimits(min_ttft_ms=50, max_ttft_ms=5000, min_tpot_ms=5, max_tpot_ms=500)
    assert _spec(lim, ttft_ms=50, tpot_ms=500).slo == _spec(lim, ttft_ms=49.9, tpot_ms=500.1).slo
    at = _spec(lim, ttft_ms=5000, tpot_ms=5).slo
    assert (at.ttft_s, at.tpot_s) == pytest.approx((5.0, 0.005))
    past = _spec(lim, ttft_ms=1e12, tpot_ms=1e-9).slo
    assert (past.ttft_s, past.tpot_s) == pytest.approx((5.0, 0.005))
    with pytest.raises(InvalidRequestError, match="^ttft_ms: "):
        _spec(lim, ttft_ms=float("inf"))


def test_priority_ignored_under_fcfs():
    assert _spec(priority=-7).priority == 0 and _spec(priority=10**6).priority == 0


def test_priority_honoured_in_range_under_priority_policy():
    lim = ServerLimits(scheduling_policy=SchedulingPolicy.PRIORITY, min_priority=-2, max_priority=3)
    assert _spec(lim, priority=-2).priority == -2 and _spec(lim, priority=3).priority == 3
    assert _spec(lim).priority == 0
    for bad in (-3, 4):
        with pytest.raises(InvalidRequestError) as info:
            _spec(lim, priority=bad)
        assert info.value.field == "priority" and "[-2, 3]" in str(info.value)


# ---------------------------------------------------------------- admission queue


def test_admission_queue_cap_answers_at_once():
    async def scenario():
        admission = admission_cluster(decode_inflight=60)
        admission.max_queued = 2
        waiters = [asyncio.create_task(admission.acquire(admission_spec(ttft=5.0, tpot=0.05))) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert admission.num_queued == 2   # at the cap: both wait
        with pytest.raises(CapacityError, match="^max_queued_requests: ") as refused:
            await asyncio.wait_for(admission.acquire(admission_spec(ttft=5.0, tpot=0.05)), 0.5)
        assert refused.value.reason == "queue_full"
        sent_to_decode(admission.registry.decode[0], 0)
        admission.notify()
        await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
        assert admission.num_queued == 0

    asyncio.run(scenario())


def test_wakeup_wakes_the_oldest_few_fifo():
    async def scenario():
        wake = FairWakeup()
        tickets = [wake.enter() for _ in range(5)]
        order: list[int] = []

        async def waiter(t):
            await wake.wait(t, 2.0)
            order.append(t)

        tasks = [asyncio.create_task(waiter(t)) for t in reversed(tickets)]   # waiting order must not matter
        await asyncio.sleep(0.01)
        wake.wake(2)
        await asyncio.sleep(0.01)
        assert sorted(order) == tickets[:2]
        for t in tickets[:2]:
            wake.leave(t)
        wake.wake(2)
        await asyncio.gather(*tasks[:3])   # the remaining oldest two now, then the last
        assert sorted(order[2:4]) == tickets[2:4]
        wake.wake(8)
        await asyncio.gather(*tasks)
        assert len(wake) == 3

    asyncio.run(scenario())


def test_wakeup_tells_each_waiter_what_woke_it():
    """A wake names its source; a second wake from another source before the waiter ran, or a
    timeout, reads as None (anything may have changed)."""
    async def scenario():
        wake = FairWakeup()
        a, b, c = (wake.enter() for _ in range(3))
        worker, other = object(), object()
        wake.wake(2, worker)
        assert await wake.wait(a, 1.0) is worker and await wake.wait(b, 1.0) is worker
        wake.wake(3, worker)
        wake.wake(3, worker)               # the same source again: still that one
        assert await wake.wait(c, 1.0) is worker
        wake.wake(3, worker)
        wake.wake(3, other)                # two sources before the waiter ran
        assert await wake.wait(a, 1.0) is None
        assert await wake.wait(b, 1.0) is None and await wake.wait(c, 1.0) is None
        assert await wake.wait(a, 0.01) is None   # timed out
        for t in (a, b, c):
            wake.leave(t)
        assert not wake._sources

    asyncio.run(scenario())


def test_wakeup_checks_a_named_source_first_and_wakes_only_the_waiters_it_could_take():
    """A waiter's check runs in ``wake`` for a named source: one the source cannot take is not
    woken (no task switch) but still goes to the back, so the next wake checks the next ones;
    a wake naming no source, or a waiter already woken, is not checked."""
    async def scenario():
        wake = FairWakeup()
        full, roomy = object(), object()
        checked: list[int] = []

        def check(ticket):
            return lambda source: checked.append(ticket) or source is roomy

        tickets: list[int] = []
        for _ in range(4):
            tickets.append(wake.enter(check(len(tickets))))
        set_now = lambda: [t for t in tickets if wake._waiters[t].is_set()]  # noqa: E731
        wake.wake(2, full)
        wake.wake(2, full)
        assert checked == [0, 1, 2, 3] and set_now() == []
        wake.wake(2, roomy)
        assert checked[4:] == [0, 1] and set_now() == tickets[:2]
        wake.wake(2, None)                 # anything may have changed: no check
        assert checked[6:] == [] and set_now() == tickets
        wake.wake(4, full)                 # all four already woken: none checked, each now reads None
        assert checked[6:] == [] and [await wake.wait(t, 1.0) for t in tickets] == [None] * 4

    asyncio.run(scenario())


def test_wakeup_a_check_that_raises_wakes_its_waiter_and_not_the_reporter():
    """The error is the waiter's: its own task checks again and meets it there."""
    async def scenario():
        wake = FairWakeup()
        ticket = wake.enter(lambda source: 1 / 0)
        wake.wake(1, object())
        assert wake._waiters[ticket].is_set()

    asyncio.run(scenario())


def test_wakeup_rotates_so_waiters_that_stay_queued_cannot_starve_later_ones():
    async def scenario():
        wake = FairWakeup()
        tickets = [wake.enter() for _ in range(4)]
        woken: list[list[int]] = []
        for _ in range(2):   # two reports, each waking 2: every waiter gets re-evaluated
            wake.wake(2)
            woken.append([t for t in tickets if wake._waiters[t].is_set()])
            for t in tickets:
                wake._waiters[t].clear()   # they decided again and stayed queued
        return tickets, woken

    tickets, woken = asyncio.run(scenario())
    assert woken == [tickets[:2], tickets[2:]]


def test_wakeup_wakes_lower_ranks_first_and_rotates_within_each():
    """Ranks are priorities: a wake offers capacity to the lowest rank first (oldest first
    within it), spilling into the next rank only when that one has fewer than ``n`` waiters;
    each rank rotates on its own, so its waiters that stay queued do not starve its later ones;
    one waiter more per wake comes from a rotation over every rank, woken last."""
    async def scenario():
        wake = FairWakeup()
        low = [wake.enter(rank=10) for _ in range(2)]      # came first
        high = [wake.enter(rank=0) for _ in range(3)]
        woken: list[list[int]] = []
        for n in (2, 2, 4):
            wake.wake(n)
            woken.append([t for t in high + low if wake._waiters[t].is_set()])
            for t in high + low:
                wake._waiters[t].clear()   # they decided again and stayed queued
        wake.leave(high[0])
        assert len(wake) == 4
        for t in high[1:] + low:
            wake.leave(t)
        assert len(wake) == 0 and not wake._rotations
        return high, low, woken

    high, low, woken = asyncio.run(scenario())
    # Each wake: the higher class first, oldest first; then one more in the rotation over every
    # rank (oldest arrival first: the lower class's, which came first).
    assert woken[0] == high[:2] + low[:1]
    assert woken[1] == [high[0], high[2], low[1]]   # rotated: its third, then its first again
    assert woken[2] == high + low[:1]               # more than the class holds: the lower one's oldest too


def test_wakeup_offers_a_lower_rank_what_the_higher_ones_cannot_take():
    """A report of a worker none of the higher rank's waiters can use (their checks say no) is
    still offered to the lower rank's: each rank present has its next ``n`` checked until ``n``
    are woken. Under strict rank order alone, a lower-class request that worker could take
    waited out its deadline behind higher-class ones that could not."""
    async def scenario():
        wake = FairWakeup()
        roomy = object()
        high = [wake.enter(lambda source: False, rank=0) for _ in range(4)]   # more than n: none can take it
        low = [wake.enter(lambda source: source is roomy, rank=10) for _ in range(3)]
        wake.wake(2, roomy)
        return [t for t in high + low if wake._waiters[t].is_set()], low

    woken, low = asyncio.run(scenario())
    assert woken == low[:2]


def test_wakeup_reaches_every_rank_within_as_many_wakes_as_waiters():
    """Found by review: 8 higher-rank waiters that every wake takes (no check: migrating
    requests, reservation retries) kept a lower rank's waiter from ever being offered one. One
    waiter per wake in a rotation over every rank bounds that wait."""
    async def scenario():
        wake = FairWakeup()
        high = [wake.enter(rank=0) for _ in range(8)]
        low = wake.enter(lambda source: True, rank=10)
        for reports in range(1, 10):
            wake.wake(8, object())
            if wake._waiters[low].is_set():
                return reports
            for t in high:
                wake._waiters[t].clear()   # they decided again and stayed queued
        return None

    assert asyncio.run(scenario()) is not None
