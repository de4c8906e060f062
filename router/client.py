"""A small Python client for pdserve's Generate and ServerInfo calls, sync and asyncio.

Life cycle: a client owns one channel (``close()`` it, or use it as a context manager); each
``generate`` call is one server stream. Stopping the iteration early (``break``, an exception,
closing the generator) cancels the RPC, which the server turns into an abort that frees the
request's KV blocks. ``generate_text`` drains the stream into a ``GenerationResult``.

Security (``router/channel.py``): ``tls_ca`` / ``tls_cert`` / ``tls_key`` (file paths or PEM
bytes; any of them turns TLS on, ``tls=True`` uses the system's CA roots) and ``auth_token``,
sent as ``authorization: Bearer <token>`` with every call.

Sampling keyword arguments mirror ``SamplingParams`` in the proto; one left out, or passed as
``None``, stays unset and so takes the server's default (an explicit ``temperature=0`` is greedy
even where the server's default is not). Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import FinishReason, PromptLogprobs
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.channel import ClientSecurity, open_channel
from router.convert import RequestTimings, Usage, finish_reason_from_proto, timings_from_proto, usage_from_proto
from router.pem import PemSource

SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
ChatInput = Sequence[Mapping[str, str] | tuple[str, str] | pb.ChatMessage]


@dataclass(slots=True)
class GenerationResult:
    """A whole stream, collected."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)   # with sampling top_logprobs
    prompt_logprobs: PromptLogprobs | None = None   # with sampling prompt_logprobs (the first message's)
    error: str = ""
    num_messages: int = 0

    def add(self, resp: pb.GenerateResponse) -> None:
        self.request_id = resp.request_id or self.request_id
        self.token_ids.extend(resp.token_ids)
        self.text += resp.text
        self.logprobs.extend(resp.logprobs)
        self.top_logprobs.extend(list(zip(top.token_ids, top.logprobs)) for top in resp.top_logprobs)
        if resp.HasField("prompt_logprobs"):
            p = resp.prompt_logprobs
            self.prompt_logprobs = PromptLogprobs(tuple(p.token_ids), tuple(p.logprobs), tuple(p.ranks),
                                                  tuple(tuple(zip(t.token_ids, t.logprobs)) for t in p.top_logprobs))
        self.num_messages += 1
        self.finish_reason = finish_reason_from_proto(resp.finish_reason) or self.finish_reason
        self.error = resp.error or self.error
        if resp.HasField("usage"):
            self.usage = usage_from_proto(resp.usage)
        if resp.HasField("timings"):
            self.timings = timings_from_proto(resp.timings)


def _chat_message(m: Mapping[str, str] | tuple[str, str] | pb.ChatMessage) -> pb.ChatMessage:
    if isinstance(m, pb.ChatMessage):
        return m
    if isinstance(m, Mapping):   # OpenAI's message shape; an assistant's tool_calls as a list
        calls = m.get("tool_calls")
        return pb.ChatMessage(role=m.get("role", ""), content=m.get("content") or "",
                              tool_calls_json=json.dumps(calls) if calls else "",
                              tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
    role, content = m
    return pb.ChatMessage(role=role, content=content)


def build_request(
    text: str | None = None,
    chat: ChatInput | None = None,
    token_ids: Iterable[int] | None = None,
    *,
    request_id: str | None = None,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    priority: int | None = None,
    skip_special_tokens: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A ``GenerateRequest``; exactly one of ``text``, ``chat``, ``token_ids``; ``tools`` (OpenAI
    function definitions) go to the chat's template. The server validates values; this only
    rejects what cannot be expressed (unknown names, two prompts, tools without a chat)."""
    if sum(p is not None for p in (text, chat, token_ids)) != 1:
        raise TypeError("pass exactly one of text, chat or token_ids")
    if tools is not None and chat is None:
        raise TypeError("tools go with a chat")
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    if text is not None:
        req.text = text
    elif chat is not None:
        req.chat.SetInParent()  # an empty chat still selects the oneof, so the server can name it
        req.chat.messages.extend(_chat_message(m) for m in chat)
        if tools is not None:
            req.chat.tools_json = json.dumps(list(tools))
    else:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(token_ids)
    optional = {"request_id": request_id, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "priority": priority,
                "skip_special_tokens": skip_special_tokens}
    for name, value in optional.items():
        if value is not None:
            setattr(req, name, value)
    return req


class PdserveClient:
    """Blocking client over one ``grpc`` channel."""

    def __init__(
        self, address: str, *, timeout_s: float | None = None, options: Sequence[tuple[str, Any]] = (),
        tls: bool = False, tls_ca: PemSource | None = None, tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None, auth_token: str | None = None,
    ) -> None:
        security = ClientSecurity.of(tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, auth_token=auth_token)
        self._channel = open_channel(address, security, options)
        self._stub = pb_grpc.PdserveStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = security.metadata()

    def generate(
        self,
        text: str | None = None,
        chat: ChatInput | None = None,
        token_ids: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream messages as they come. The RPC starts now; bad arguments raise here, not on
        the first ``next()``."""
        call = self._stub.Generate(build_request(text, chat, token_ids, **kwargs), timeout=self._timeout_s, metadata=self._metadata)
        return _stream(call)

    def generate_text(
        self,
        text: str | None = None,
        chat: ChatInput | None = None,
        token_ids: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        result = GenerationResult()
        for resp in self.generate(text, chat, token_ids, **kwargs):
            result.add(resp)
        return result

    def server_info(self, timeout_s: float | None = None) -> pb.ServerInfoResponse:
        """What the server serves; ``timeout_s`` bounds this call (default: the client's timeout)."""
        return self._stub.ServerInfo(pb.ServerInfoRequest(), timeout=timeout_s or self._timeout_s, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stream(call: Any) -> Iterator[pb.GenerateResponse]:
    try:
        yield from call
    finally:
        call.cancel()  # a no-op once the stream ended; aborts the request if the caller left early


class AsyncPdserveClient:
    """``grpc.aio`` client; make it inside the event loop that uses it."""

    def __init__(
        self, address: str, *, timeout_s: float | None = None, options: Sequence[tuple[str, Any]] = (),
        tls: bool = False, tls_ca: PemSource | None = None, tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None, auth_token: str | None = None,
    ) -> None:
        security = ClientSecurity.of(tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, auth_token=auth_token)
        self._channel = open_channel(address, security, options, use_aio=True)
        self._stub = pb_grpc.PdserveStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = security.metadata()

    def generate(
        self,
        text: str | None = None,
        chat: ChatInput | None = None,
        token_ids: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self._stub.Generate(build_request(text, chat, token_ids, **kwargs), timeout=self._timeout_s, metadata=self._metadata)
        return _astream(call)

    async def generate_text(
        self,
        text: str | None = None,
        chat: ChatInput | None = None,
        token_ids: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        result = GenerationResult()
        async for resp in self.generate(text, chat, token_ids, **kwargs):
            result.add(resp)
        return result

    async def server_info(self, timeout_s: float | None = None) -> pb.ServerInfoResponse:
        """What the server serves; ``timeout_s`` bounds this call (default: the client's timeout)."""
        return await self._stub.ServerInfo(pb.ServerInfoRequest(), timeout=timeout_s or self._timeout_s,
                                           metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPdserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _astream(call: Any) -> AsyncIterator[pb.GenerateResponse]:
    try:
        async for resp in call:
            yield resp
    finally:
        call.cancel()
