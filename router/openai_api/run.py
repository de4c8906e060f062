"""Runs one OpenAI request inside its HTTP connection's task and writes its response.

Life cycle: ``GenerationResponse.__call__`` (the ASGI response FastAPI hands back) claims the
request's identity (``GenerationCore.claim``) and starts watching the connection; the request
then runs through ``GenerationCore.stream`` in this same task, so that
  - a client that disconnects (``http.disconnect``) cancels the task: the orchestrator's
    cleanup aborts the request on every worker and frees its KV, and nothing more is written;
  - a client that stops reading blocks this task in ``send`` (uvicorn's flow control) while the
    request's ``DeltaQueue`` fills, which then cancels it with ``SLOW_READER``, as over gRPC;
  - a request still live when the server stops is cancelled with ``CUT_AT_STOP``
    (``LiveRequests.cut``) and answered 503, or an error event, naming the shutdown.
Streaming waits for the first event before it sends a status (the format frames what follows: chat and
completions chunks ending in ``[DONE]``, or the Responses API's typed events), so everything refused before the
first token (bad input 400, duplicate id 409, admission 429, no worker 503) is an HTTP status
with OpenAI's error body; an error after that is one ``data: {"error": ...}`` event followed by
``data: [DONE]`` (the Responses API: ``error`` then ``response.failed``). Non-streaming sends one
JSON body at the end. ``release`` always runs.
With ``n`` > 1 the choices run side by side (``fan_in``): every choice's identity is claimed
before any runs, their events are formatted each with its own ``ResponseFormat`` (its index), the
first error ends the response, and the usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.responses import Response

from protos import pdserve_pb2 as pb
from router.generation import GenerationCore, GenerationEvent
from router.identity import RequestIdentity
from router.openai_api import errors
from router.openai_api.fan_in import merged
from router.openai_api.requests import param_for
from router.openai_api.responses import ResponseFormat, usage_total
from router.openai_api.responses_api import ResponsesFormat

logger = logging.getLogger(__name__)

CLIENT_GONE = "pdserve: http client disconnected"
SLOW_READER_GRACE_S = 1.0    # a reader that stopped reading may still take the error event; no longer
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_JSON_HEADERS = [(b"content-type", b"application/json")]


class GenerationResponse(Response):
    def __init__(self, core: GenerationCore, requests: list[pb.GenerateRequest],
                 fmts: list[ResponseFormat] | list[ResponsesFormat], *,
                 stream: bool, sent_as: dict[str, str] | None = None, choices_per_prompt: int = 1,
                 trace_context: dict[str, str] | None = None) -> None:
        """One request per choice (``fan_in.choices``; a batch: each prompt's n in turn) and one
        format each; ``trace_context``: the client's (``tracing.client_context``)."""
        super().__init__(status_code=200)
        self.core, self.requests, self.fmts, self.stream = core, requests, fmts, stream
        self.choices_per_prompt = choices_per_prompt
        self.trace_context = trace_context
        self.fmt = fmts[0]
        self._sent_as = sent_as   # field paths -> the parameter names this body used (param_for)
        self._started = False     # a status line went out: errors are events from now on
        self._done = False        # the last body went out: a disconnect now means nothing

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(lambda w: self._on_disconnect(w, task))
        identities: list[RequestIdentity] = []
        try:
            for request in self.requests:   # all or none: a refused one releases the others (finally)
                identities.append(await self.core.claim(request))
            await self._run(identities, send)
        except asyncio.CancelledError as exc:
            await self._cancelled(exc, _first(identities), send, task)
        except Exception as exc:
            await self._fail(exc, _first(identities), send)
        finally:
            self._done = True
            watcher.cancel()
            for identity in identities:
                self.core.release(identity)

    def _on_disconnect(self, watcher: asyncio.Future, task: asyncio.Task) -> None:
        if not watcher.cancelled() and not self._done:
            task.cancel(CLIENT_GONE)

    async def _cancelled(self, exc: asyncio.CancelledError, identity, send, task: asyncio.Task) -> None:
        ours = self.core.server_cancel(exc)   # a slow reader, or cut at the stop
        if ours is not None:
            with contextlib.suppress(asyncio.TimeoutError):   # a slow reader may not read this either
                await asyncio.wait_for(self._fail(ours, identity, send), SLOW_READER_GRACE_S)
            return
        if exc.args[:1] != (CLIENT_GONE,):
            raise   # the server is stopping
        task.uncancel()   # the client left: the request is aborted, there is no one to answer
        logger.debug("client of %s disconnected", identity.req_id if identity else "-")

    async def _run(self, identities: list[RequestIdentity], send) -> None:
        if len(identities) == 1:
            stream = self.core.stream(self.requests[0], identities[0], door="http", trace_context=self.trace_context)
            events = _indexed(stream)
        else:
            batch_of = self.choices_per_prompt if len(self.requests) > self.choices_per_prompt else 0
            events = stream = merged(self.core, self.requests, identities, door="http", batch_of=batch_of,
                                     trace_context=self.trace_context)
        async with contextlib.aclosing(stream), contextlib.aclosing(events):
            if self.stream:
                await self._stream(events, send)
            else:
                by_choice: list[list[GenerationEvent]] = [[] for _ in self.fmts]
                async for index, event in events:
                    by_choice[index].append(event)
                body = self.fmt.combine([f.whole(e) for f, e in zip(self.fmts, by_choice)],
                                        [e[-1].usage for e in by_choice], self.choices_per_prompt)
                await self._send_whole(200, json.dumps(body).encode(), send)

    async def _stream(self, events, send) -> None:
        last: list[GenerationEvent | None] = [None] * len(self.fmts)
        async for index, event in events:
            head = b""
            if not self._started:   # the first event: the request is accepted, the stream begins
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                self._started = True
                head = self.fmt.stream_head()
            body = head + self.fmts[index].stream_event(event)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            last[index] = event
        usage = usage_total([e.usage if e is not None else None for e in last], self.choices_per_prompt)
        self._done = True
        tail = self.fmt.stream_tail(next((e for e in reversed(last) if e is not None), None), usage)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _fail(self, exc: BaseException, identity: RequestIdentity | None, send) -> None:
        err = self._api_error(exc, identity)
        self._done = True
        if self._started:
            await send({"type": "http.response.body", "body": self.fmt.stream_error(err.body()), "more_body": False})
        else:
            await self._send_whole(err.status, err.json_bytes(), send, err.headers())

    def _api_error(self, exc: BaseException, identity: RequestIdentity | None) -> errors.ApiError:
        code, message = self.core.failure(exc, identity)
        chat = self.fmt.chat
        return errors.from_status(code, message, exc,
                                  lambda f: param_for(f, chat=chat, sent_as=self._sent_as))

    async def _send_whole(self, status: int, body: bytes, send, headers: dict[str, str] | None = None) -> None:
        self._done = True
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS + extra})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _indexed(events):
    """One choice's events as ``merged`` gives n choices': (0, event)."""
    async for event in events:
        yield 0, event


def _first(identities: list[RequestIdentity]) -> RequestIdentity | None:
    """The identity an error names (the first choice's: the client's label)."""
    return identities[0] if identities else None


async def _disconnected(receive) -> Any:
    """Returns once the client is gone (the request body was read before the handler ran)."""
    while (await receive())["type"] != "http.disconnect":
        pass
