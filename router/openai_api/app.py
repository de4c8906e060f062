"""The FastAPI app: routes, bearer-token auth, the request body's size cap, OpenAI error bodies.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (stateless:
``responses_api.py``), ``/v1/models`` and one model by name
(``/v1/models/{model}``; a name may hold slashes), ``/health``; and, as vLLM's API server has them,
``/metrics`` (the router's Prometheus exposition, the same as the metrics port's, so a scrape
config written for vLLM's port works), ``/version``, ``/tokenize`` (a prompt's or a chat's token
ids, as generation would feed them to the model) and ``/detokenize``. Every route but ``GET /health``
needs ``Authorization: Bearer <token>`` when the router has a token (the same token and the same
constant-time check as gRPC: ``router.auth.check_bearer``); ``/health`` stays open, like
grpc.health.v1, and follows it: 200 while a serving path exists, 503 otherwise. A body is read up
to ``max_receive_message_bytes`` (gRPC's cap on one message) and refused past it before it is
parsed; at most ``max_concurrent_streams`` bodies are received at once (429 past it), each within
``http_receive_timeout_s`` (408 past it); a client that leaves mid-body is no error. The client's
``X-Request-Id`` header is the request's label (one live request per label: 409 otherwise), echoed
in the response's ``id``; the router's own id never leaves it. Every error, our own bugs' too, is
a body in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine import tracing
from engine.errors import CapacityError, InvalidRequestError
from router.auth import check_bearer
from router.generation import GenerationCore
from router.health import ServingHealth
from router.openai_api import errors
from router.openai_api.errors import ApiError
from router.openai_api.fan_in import choices
from router.openai_api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest,
                                       TokenizeRequest)
from router.openai_api.requests import (chat_request, completion_requests, echo_texts, param_for, parse, sent_as,
                                        tokenize_request)
from router.openai_api import responses_api
from router.openai_api.responses import ResponseFormat
from router.openai_api.responses_api import ResponsesFormat
from router.openai_api.run import GenerationResponse
from router.openai_api import tool_calls
from router.openai_api.tool_calls import ToolPlan

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_GENERATION_BODIES = (ChatCompletionRequest, CompletionRequest, ResponsesRequest)   # requests counted by outcome


def _installed_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:   # a source tree run without installing it
        return "unknown"


_VERSION = _installed_version()


@dataclass(frozen=True, slots=True)
class ApiConfig:
    model: str                       # the served model's name: /v1/models lists it, requests must name it
    max_model_len: int
    auth_token: str | None = None
    tool_call_parser: str | None = None   # the model's tool-call syntax (tool_parsers/): tool_choice "auto"


def build_app(core: GenerationCore, health: ServingHealth, config: ApiConfig) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(core, health, config)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, api.internal_error)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/responses", api.responses, methods=["POST"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    return app


def _in_responses_words(chat: ChatCompletionRequest, label: str):
    try:
        return chat_request(chat, label, None)
    except InvalidRequestError as exc:
        raise responses_api.in_our_words(exc) from None


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client left while its body was arriving: no request was made, no one reads an answer."""
    logger.debug("client left before its request body was complete")
    return Response(status_code=499)   # nginx's "client closed request": never sent, for the record


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = ApiError(exc.status_code, str(exc.detail), kind, None, None).body()
    return JSONResponse(body, status_code=exc.status_code)


class _Api:
    def __init__(self, core: GenerationCore, health: ServingHealth, config: ApiConfig) -> None:
        self.core, self.serving_health, self.config = core, health, config
        self._token = config.auth_token.encode() if config.auth_token else None
        self._created = int(time.time())
        self._receiving = 0   # request bodies being received now (``_check_receiving``)

    async def health(self) -> JSONResponse:
        serving = bool(self.serving_health.serving)
        return JSONResponse({"status": "serving" if serving else "not_serving"}, status_code=200 if serving else 503)

    async def metrics(self, request: Request) -> Response:
        self._authorize(request)
        if self.core.metrics is None:
            raise errors.not_found("this router keeps no metrics")
        return Response(self.core.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"version": _VERSION})

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request, model: str) -> JSONResponse:
        """One model by name (the openai package's ``models.retrieve``)."""
        self._authorize(request)
        self._check_model(model)
        return JSONResponse(self._model_object())

    async def chat(self, request: Request) -> GenerationResponse:
        req, label = await self._parse(request, ChatCompletionRequest)
        tools = self._checked(tool_calls.plan, req, self.config.tool_call_parser)
        msg = self._checked(chat_request, req, label, tools)
        return self._response(request, [msg], [None], req, label, chat=True, logprobs=req.logprobs, tools=tools)

    async def responses(self, request: Request) -> GenerationResponse:
        """OpenAI's Responses API, stateless, as the chat request it means (``responses_api.py``)."""
        req, label = await self._parse(request, ResponsesRequest)
        chat = self._checked(responses_api.chat_body, req)
        msg = self._checked(_in_responses_words, chat, label)
        return GenerationResponse(self.core, [msg], [ResponsesFormat("resp_" + label, self.config.model, req)],
                                  stream=req.stream, sent_as=responses_api.SENT_AS,
                                  trace_context=tracing.client_context(request.headers.items()))

    async def completions(self, request: Request) -> GenerationResponse:
        req, label = await self._parse(request, CompletionRequest)
        msgs = self._checked(completion_requests, req, label)
        # Decoding a batch of token-id prompts is tokenizer work: off the event loop that streams.
        echoes = await self._as_client_error(self.core.on_tokenizer_pool(
            echo_texts, req, self.core.tokenizer, self.core.defaults.vocab_size), chat=False) if req.echo \
            else [None] * len(msgs)
        return self._response(request, msgs, echoes, req, label, chat=False, logprobs=req.logprobs is not None)

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/tokenize``: the ids a generation request with this prompt (or these messages,
        through the chat template) would feed the model."""
        req, _ = await self._parse(request, TokenizeRequest)
        msg = self._checked(tokenize_request, req, counted=False)
        ids = await self._as_client_error(self.core.prompt_ids(msg), chat=req.messages is not None, counted=False)
        strs = await self.core.on_tokenizer_pool(self.core.tokenizer.convert_ids_to_tokens, ids) \
            if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/detokenize``: the text of token ids, special tokens included."""
        req, _ = await self._parse(request, DetokenizeRequest)
        text = await self._as_client_error(self.core.text_of(list(req.tokens), "tokens"), chat=False, counted=False)
        return JSONResponse({"prompt": text})

    async def internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        """Our bug outside a running request (``run.py`` answers those): OpenAI's error body with
        a reference to the router's log (``router.errors`` words and logs it), not Starlette's
        plain-text page."""
        code, message = self.core.failure(exc, None)
        err = errors.from_status(code, message)
        return JSONResponse(err.body(), status_code=err.status)

    # ---- pieces ---------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        result = check_bearer(self._token, [("authorization", v) for v in request.headers.getlist("authorization")])
        if not result.allowed:
            raise errors.unauthorized(f"{result.value} bearer token (header 'Authorization: Bearer <token>')")

    async def _parse(self, request: Request, model: type):
        """The body as ``model``, and the request's label: the client's ``X-Request-Id``, else one
        made here (the response's ``id`` and the trace name the same). A generation body refused
        is a request counted (as ``invalid``); a ``/tokenize`` or ``/detokenize`` body is not."""
        self._authorize(request)
        body = await self._body(request)
        counted = model in _GENERATION_BODIES
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._bad("body", f"not valid JSON: {exc}", counted=counted) from None
        except RecursionError:   # Python's parser recurses per level: '[' * 5000 would be a 500
            raise self._bad("body", "JSON nested too deeply", counted=counted) from None
        except ValueError:   # an integer past Python's int-from-text limit (4,300 digits) would be a 500
            raise self._bad("body", f"a number in it has more than {sys.get_int_max_str_digits()} digits",
                            counted=counted) from None
        req = self._checked(parse, model, data, counted=counted)
        if req.model is not None:
            self._check_model(req.model, counted=counted)
        label = request.headers.get(REQUEST_ID_HEADER)
        return req, uuid.uuid4().hex if label is None else label

    def _check_model(self, name: str, *, counted: bool = False) -> None:
        if name != self.config.model:
            if counted:   # a generation request refused: counted as the client's mistake, as a 400 is
                self._count_invalid()
            raise errors.not_found(f"the model {name!r} does not exist; this server serves "
                                   f"{self.config.model!r}", "model")

    def _model_object(self) -> dict:
        return {"id": self.config.model, "object": "model", "created": self._created, "owned_by": "pdserve",
                "max_model_len": self.config.max_model_len}

    async def _body(self, request: Request) -> bytes:
        limit = self.core.limits.max_receive_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.too_large(int(declared), limit)
        self._check_receiving()
        self._receiving += 1
        timeout_s = self.core.limits.http_receive_timeout_s
        try:
            async with asyncio.timeout(timeout_s):   # a stalled upload gives its place up
                chunks, size = [], 0
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise errors.too_large(size, limit)
                    chunks.append(chunk)
            return b"".join(chunks)
        except TimeoutError:
            raise errors.body_timeout(timeout_s) from None
        finally:
            self._receiving -= 1

    def _check_receiving(self) -> None:
        """Bodies arriving at once are bounded as live calls are (``max_concurrent_streams``): each
        may hold up to ``max_receive_message_bytes`` until it is complete, so clients that upload
        slowly, or never finish, cannot grow the router's memory without bound (gRPC's calls
        are bounded by core's pending-call limit and flow control). Past it: 429 at once."""
        cap = self.core.limits.max_concurrent_streams
        if self._receiving < cap:
            return
        exc = CapacityError(f"max_concurrent_streams: {cap} request bodies are being received; retry later",
                            "max_streams")
        if self.core.metrics is not None:   # refused before admission: counted as gRPC's max_streams refusals
            self.core.metrics.request_rejected(exc.reason)
        code, message = self.core.failure(exc, None)
        raise errors.from_status(code, message, exc)

    def _checked(self, fn, *args, counted: bool = True):
        """``fn(*args)``; bad input is a 400 (``counted``: like gRPC's INVALID_ARGUMENT)."""
        try:
            return fn(*args)
        except InvalidRequestError as exc:
            raise self._bad(exc.field, exc.message, counted=counted) from None

    async def _as_client_error(self, call, *, chat: bool, counted: bool = True):
        """Await ``call``; bad input is a 400 naming the OpenAI parameter (``param_for``)."""
        try:
            return await call
        except InvalidRequestError as exc:
            raise self._bad(param_for(exc.field, chat=chat), exc.message, counted=counted) from None

    def _bad(self, param: str, message: str, *, counted: bool = True) -> ApiError:
        """A 400; ``counted``: a generation request refused (``/tokenize``'s is no request)."""
        if counted:
            self._count_invalid()
        return ApiError(400, f"{param}: {message}", "invalid_request_error", param,
                        grpc.StatusCode.INVALID_ARGUMENT.name.lower())

    def _count_invalid(self) -> None:
        if self.core.metrics is not None:
            self.core.metrics.request_invalid()

    def _response(self, request: Request, msgs: list, echoes: list[str | None], req, label: str, *, chat: bool,
                  logprobs: bool, tools: ToolPlan | None = None) -> GenerationResponse:
        """One response over every prompt's (``msgs``, each with its ``echoes`` text) ``n`` choices;
        the trace context the client's ``request`` carries is continued."""
        prefix = "chatcmpl-" if chat else "cmpl-"
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        response_id = prefix + label
        first = ResponseFormat(chat, response_id, self.config.model, logprobs=logprobs, include_usage=include_usage,
                               tokenizer=self.core.tokenizer, prompt_logprobs=req.prompt_logprobs is not None,
                               echo=echoes[0], tools=tools)
        requests = [choice for msg in msgs for choice in choices(msg, req.n)]
        fmts = [first] + [first.for_choice(i, echoes[i // req.n]) for i in range(1, len(requests))]
        return GenerationResponse(self.core, requests, fmts, stream=req.stream,
                                  sent_as=sent_as(req, chat=chat, tools=tools),
                                  choices_per_prompt=req.n,
                                  trace_context=tracing.client_context(request.headers.items()))
