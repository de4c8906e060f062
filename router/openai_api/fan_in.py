"""An OpenAI request with ``n`` > 1 (or a completions batch of prompts, each with its n): its
choices run as generations side by side, and their events come back as one stream of (choice
index, event), in the order they arrive.

Why a request per choice: each choice is a whole generation (its own sampling, KV, admission);
sharing the prompt costs nothing extra where prefix caching is on (the later choices find the
first one's prompt blocks). ``choices`` makes the n ``GenerateRequest``s: the first as the client
sent it (its ``X-Request-Id`` label, claimed as any request's), the others with labels the router
makes, and with a seed each choice's own (seed + index), so a seeded request gives the same n
answers every time and not n copies of one.

Life cycle of ``merged``: every choice is tokenized and validated first (``GenerationCore.spec``), so a
body with one bad prompt is refused whole before any choice runs (counted once, as ``invalid``,
with nothing admitted or aborted); then one pump task per choice reads its ``GenerationCore.stream`` into a queue
of n places (a reader that stops reading stops the pumps, so the choices' own ``DeltaQueue``s
fill, as one stream's does); the caller's task reads the queue. A choice that fails ends the
whole response with its error; a pump cancelled as a slow reader (``SLOW_READER``) passes that
cancel on to the caller's task, which answers it as for one stream; when the caller's iteration
ends, however it ends, every pump is cancelled and awaited, which aborts the choices still
running on the workers (the generation's own cleanup).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from engine import tracing
from engine.errors import InvalidRequestError
from engine.types import RequestSpec
from protos import pdserve_pb2 as pb
from router.delta_queue import SLOW_READER
from router.errors import fault_of
from router.generation import GenerationCore, GenerationEvent
from router.identity import RequestIdentity
from router.openai_api.requests import in_batch

SEED_RANGE = 2**63   # seed + i kept an int64; the sampler reads seeds mod 2**63, so it samples as seed + i


def choices(request: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """The n requests of one OpenAI request: the first is ``request`` itself."""
    out = [request]
    for index in range(1, n):
        copy = pb.GenerateRequest()
        copy.CopyFrom(request)
        copy.ClearField("request_id")   # one live request per label: the router makes the others'
        if request.sampling.HasField("seed"):
            copy.sampling.seed = (request.sampling.seed + index) % SEED_RANGE
        out.append(copy)
    return out


async def merged(core: GenerationCore, requests: list[pb.GenerateRequest], identities: list[RequestIdentity],
                 door: str, batch_of: int = 0,
                 trace_context: dict[str, str] | None = None) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Every choice's events as (index, event); ends when every choice has ended. ``batch_of``:
    the choices per prompt of a completions batch (0: one prompt), for errors that name it;
    each choice's trace is a ``request`` under one ``choices`` span (under ``trace_context``,
    the client's, when given)."""
    span = tracing.start("choices", trace_context, door=door, label=identities[0].label, num_choices=len(requests))
    error: BaseException | None = None
    try:
        async with contextlib.aclosing(_merged(core, requests, identities, door, batch_of,
                                               tracing.context_of_span(span))) as events:
            async for item in events:
                yield item
    except BaseException as exc:
        error = exc
        raise
    finally:
        if span is not None:
            tracing.end(span, fault_of(error))


async def _merged(core: GenerationCore, requests: list[pb.GenerateRequest], identities: list[RequestIdentity],
                  door: str, batch_of: int, trace_context: dict[str, str] | None) -> AsyncIterator[tuple[int, GenerationEvent]]:
    try:
        specs = await asyncio.gather(*(_spec(core, r, identity, index // batch_of if batch_of else None)
                                       for index, (r, identity) in enumerate(zip(requests, identities))))
    except asyncio.CancelledError:   # the client left while they were tokenized: each an abort, as in ``stream``
        core.left_early(len(requests))
        raise
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(requests))
    caller = asyncio.current_task()
    pumps = [asyncio.ensure_future(_pump(core, i, request, identity, spec, door, queue, caller, trace_context))
             for i, (request, identity, spec) in enumerate(zip(requests, identities, specs))]
    try:
        running = len(pumps)
        while running:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                running -= 1
            else:
                yield index, event
    finally:
        for pump in pumps:
            pump.cancel()
        # The pumps' own ends (cancelled or not) are collected; a cancel of the caller itself while it
        # waits here propagates (the pumps are cancelled already and finish on their own).
        await asyncio.gather(*pumps, return_exceptions=True)


async def _spec(core: GenerationCore, request: pb.GenerateRequest, identity: RequestIdentity,
                prompt_index: int | None) -> RequestSpec:
    try:
        return await core.spec(request, identity.req_id)
    except InvalidRequestError as exc:
        if prompt_index is None:
            raise
        raise in_batch(exc, prompt_index) from None


async def _pump(core: GenerationCore, index: int, request: pb.GenerateRequest, identity: RequestIdentity,
                spec: RequestSpec, door: str, queue: asyncio.Queue, caller: asyncio.Task,
                trace_context: dict[str, str] | None) -> None:
    try:
        async with contextlib.aclosing(core.stream(request, identity, door=door, spec=spec,
                                                   trace_context=trace_context)) as events:
            async for event in events:
                await queue.put((index, event, None))
        await queue.put((index, None, None))
    except asyncio.CancelledError as exc:
        if exc.args[:1] == (SLOW_READER,):   # this choice's reader (the caller) stopped reading
            caller.cancel(SLOW_READER)
            return
        raise
    except Exception as exc:
        await queue.put((index, None, exc))
