"""Backends send one benchmark request and time its tokens: ``async send(request) -> RequestOutcome``.

``GrpcBackend`` talks to our router (token ids in, a stream of token-id messages out); each
message may carry several tokens, which all take that message's arrival time. ``OpenAIBackend``
talks to any OpenAI-compatible server over HTTP (``/v1/completions`` or ``/v1/chat/completions``,
``stream=true``, server-sent events): TTFT at the first chunk with content, ITL between content
chunks, output tokens from the final ``usage`` when the server sends one, else one per chunk.

Exact output lengths need EOS ignored, which OpenAI servers spell differently (``flavor``):
  vllm          ``ignore_eos: true`` (vLLM's extra parameter) and ``stream_options.include_usage``
  transformers  ``transformers serve`` refuses unknown fields (HTTP 422), so ``ignore_eos`` cannot be
                sent; it does take ``generation_config`` (a JSON string), and an ``eos_token_id``
                of -1 there is one no token matches. Its prompts must be text (``--tokenizer``).
  plain         only ``max_tokens``: a request may end early at EOS (outputs then vary by server)
A rejection is gRPC RESOURCE_EXHAUSTED or HTTP 429/503; any other error is a failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from deploy.bench.dataset import BenchRequest

OK, FAILED, REJECTED = "ok", "failed", "rejected"
INFO_TIMEOUT_S = 30.0   # for the server's first answer (what it serves): a silent server is named, not waited on
REJECT_HTTP_STATUSES = (429, 503)
FLAVORS = ("vllm", "transformers", "plain")


@dataclass(slots=True)
class RequestOutcome:
    idx: int
    status: str                        # ok | failed | rejected
    prompt_len: int
    expected_output_len: int
    output_len: int = 0
    ttft_s: float | None = None        # None: no token arrived
    itls: list[float] = field(default_factory=list)
    e2e_s: float | None = None         # send -> end of stream (None when it never started)
    start_s: float = 0.0               # when it was sent, from the run's start (the runner sets it)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """vLLM's TPOT: (e2e - TTFT) / (tokens - 1); undefined below two tokens."""
        if self.output_len < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


OutcomeDict = dict[str, Any]   # a RequestOutcome as saved in JSON (dataclasses.asdict)


class Backend(Protocol):
    name: str

    async def start(self) -> dict[str, Any]:
        """Connect (inside the running loop); returns what the server says about itself."""

    async def send(self, request: BenchRequest) -> RequestOutcome: ...

    async def close(self) -> None: ...


class TokenClock:
    """Arrival times of one request's tokens, from the moment it was sent."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft_s: float | None = None
        self.itls: list[float] = []
        self.num_tokens = 0

    def tokens(self, n: int) -> None:
        """``n`` tokens arrived together now: the first gap is to the previous arrival, the rest 0."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.ttft_s = now - self.start
        else:
            self.itls.append(now - self.last)
        self.itls.extend([0.0] * (n - 1))
        self.last = now
        self.num_tokens += n

    def outcome(self, req: BenchRequest, status: str, *, output_len: int | None = None,
                prompt_len: int | None = None, error: str = "") -> RequestOutcome:
        return RequestOutcome(
            idx=req.idx, status=status, prompt_len=prompt_len or req.prompt_len,
            expected_output_len=req.output_len,
            output_len=self.num_tokens if output_len is None else output_len,
            ttft_s=self.ttft_s, itls=self.itls, e2e_s=time.perf_counter() - self.start, error=error)


# ---------------------------------------------------------------- gRPC (our router)


class ServerUnreachable(ConnectionError):
    """Nothing answers at the server's address (refused, or taken and left silent): said once
    before any run, not as a table of failed requests, nor as a wait without end."""


class GrpcBackend:
    name = "grpc"

    def __init__(self, address: str, *, timeout_s: float | None = None,
                 ttft_ms: float | None = None, tpot_ms: float | None = None,
                 client_options: dict[str, Any] | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._client_options = client_options or {}   # TLS / token: AsyncPdserveClient's keywords
        self._slo_hints = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}
        self._client = None

    async def start(self) -> dict[str, Any]:
        from grpc import StatusCode, aio

        from protos import pdserve_pb2 as pb
        from router.client import AsyncPdserveClient

        self._client = AsyncPdserveClient(self.address, timeout_s=self.timeout_s, **self._client_options)
        try:
            info = await self._client.server_info(timeout_s=INFO_TIMEOUT_S)
        except aio.AioRpcError as exc:
            if exc.code() != StatusCode.DEADLINE_EXCEEDED:
                raise
            raise ServerUnreachable(f"{self.address}: no answer to ServerInfo within {INFO_TIMEOUT_S:g} s") from exc
        return {"model": info.model, "mode": pb.ServingMode.Name(info.mode).removeprefix("SERVING_MODE_").lower(),
                "vocab_size": info.vocab_size, "max_model_len": info.max_model_len}

    async def send(self, request: BenchRequest) -> RequestOutcome:
        from grpc import StatusCode, aio

        from protos import pdserve_pb2 as pb

        clock = TokenClock()
        finish, error, usage = pb.FINISH_REASON_UNSPECIFIED, "", None
        try:
            stream = self._client.generate(token_ids=request.prompt_token_ids, max_tokens=request.output_len,
                                           ignore_eos=True, temperature=0.0, **self._slo_hints)
            async for resp in stream:
                clock.tokens(len(resp.token_ids))
                finish = resp.finish_reason or finish
                error = resp.error or error
                if resp.HasField("usage"):
                    usage = resp.usage
        except aio.AioRpcError as exc:
            status = REJECTED if exc.code() == StatusCode.RESOURCE_EXHAUSTED else FAILED
            return clock.outcome(request, status, error=f"{exc.code().name}: {exc.details()}")
        if finish not in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH):
            reason = pb.FinishReason.Name(finish)
            return clock.outcome(request, FAILED, error=f"{reason}: {error}" if error else reason)
        prompt_len = usage.prompt_tokens if usage is not None else None
        return clock.outcome(request, OK, prompt_len=prompt_len)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


# ---------------------------------------------------------------- OpenAI-compatible HTTP


def parse_sse_line(line: bytes | str) -> dict | str | None:
    """One SSE line: the decoded ``data:`` JSON, ``"[DONE]"``, or None (blank, comment, other field)."""
    text = (line.decode("utf-8") if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:"):].strip()
    if data == "[DONE]":
        return data
    return json.loads(data) if data else None


def chunk_content(chunk: dict) -> str:
    """The generated text a completions or chat chunk carries ("" for role/usage-only chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:  # chat
        delta = choice["delta"] or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str, *, endpoint: str = "/v1/completions", model: str | None = None,
                 flavor: str = "vllm", extra_body: dict | None = None, timeout_s: float | None = None,
                 api_key: str | None = None) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
        # The server's root: a URL that ends in /v1 (as OpenAI clients' base_url does) loses it, since
        # the endpoints (/v1/completions, /v1/models) carry it.
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.endpoint = endpoint if endpoint.startswith("/") else "/" + endpoint
        self.chat = self.endpoint.rstrip("/").endswith("chat/completions")
        self.model, self.flavor = model, flavor
        self.extra_body = dict(extra_body or {})
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    async def start(self) -> dict[str, Any]:
        import aiohttp

        served = await self._first_model()   # also: is anything there at all (before a session to close)
        self.model = self.model or served
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        # limit=0: the benchmark decides concurrency (--max-concurrency), not the connection pool.
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                              headers=self._headers)
        return {"model": self.model or "", "mode": f"openai-{self.flavor}"}

    async def _first_model(self) -> str | None:
        """The first model ``/v1/models`` lists (None where the server has no such route); raises
        ``ServerUnreachable`` where no server answers at all."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)
        try:   # a session of its own: an error reply may close the connection, which must not be pooled
            async with aiohttp.ClientSession(timeout=timeout, headers=self._headers) as s, \
                    s.get(self.base_url + "/v1/models") as resp:
                if resp.status != 200:
                    return None
                data = (await resp.json()).get("data") or []
        except (aiohttp.ClientConnectorError, aiohttp.InvalidURL) as exc:   # refused, no route, no such name, no URL
            raise ServerUnreachable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        except asyncio.TimeoutError as exc:   # it took the connection and said nothing
            raise ServerUnreachable(f"{self.base_url}: no answer to GET /v1/models within {INFO_TIMEOUT_S:g} s") from exc
        except (aiohttp.ClientError, ValueError):
            return None   # a server without /v1/models: send no model name
        return data[0].get("id") if data else None

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"stream": True, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        if self.chat:
            if req.prompt_text is None:
                raise ValueError("chat completions need text prompts: pass --tokenizer")
            body["messages"] = [{"role": "user", "content": req.prompt_text}]
            body["max_completion_tokens"] = req.output_len
        else:
            if self.flavor == "transformers" and req.prompt_text is None:
                raise ValueError("transformers serve takes text prompts only: pass --tokenizer")
            body["prompt"] = req.prompt_text if req.prompt_text is not None else req.prompt_token_ids
            body["max_tokens"] = req.output_len
        if self.flavor == "vllm":
            body["ignore_eos"] = True
        if self.flavor in ("vllm", "plain"):
            body["stream_options"] = {"include_usage": True}
        if self.flavor == "transformers":
            body["generation_config"] = json.dumps(
                {"eos_token_id": -1, "max_new_tokens": req.output_len, "do_sample": False})
        body.update(self.extra_body)
        return body

    async def send(self, request: BenchRequest) -> RequestOutcome:
        import aiohttp

        clock = TokenClock()
        try:
            async with self._session.post(self.base_url + self.endpoint, json=self.payload(request)) as resp:
                if resp.status != 200:
                    status = REJECTED if resp.status in REJECT_HTTP_STATUSES else FAILED
                    body = (await resp.text())[:500]
                    return clock.outcome(request, status, error=f"HTTP {resp.status}: {body}")
                return await self._read_stream(resp.content, request, clock)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return clock.outcome(request, FAILED, error=f"{type(exc).__name__}: {exc}")

    async def _read_stream(self, content, request: BenchRequest, clock: TokenClock) -> RequestOutcome:
        usage: dict | None = None
        async for line in content:
            event = parse_sse_line(line)
            if event is None:
                continue
            if event == "[DONE]":
                break
            if "error" in event:
                return clock.outcome(request, FAILED, error=f"stream error: {event['error']}")
            if chunk_content(event):
                clock.tokens(1)
            usage = event.get("usage") or usage
        if clock.num_tokens == 0:
            return clock.outcome(request, FAILED, error="stream ended without content")
        usage = usage or {}
        return clock.outcome(request, OK, output_len=usage.get("completion_tokens") or clock.num_tokens,
                             prompt_len=usage.get("prompt_tokens"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
