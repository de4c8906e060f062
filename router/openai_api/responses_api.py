"""OpenAI's Responses API (``POST /v1/responses``), stateless, on the chat path: a body ->
the chat request it means, and ``GenerationEvent``s -> a ``response`` object, whole or as the
API's typed stream events.

The body. ``instructions`` is the system message, ``input`` the conversation (a text is one
user message; a list holds messages whose content is a text or ``input_text`` / ``output_text``
parts), ``max_output_tokens`` is chat's ``max_tokens``, ``text.format`` its ``response_format``;
the sampling parameters, vLLM's extras and pdserve's SLO hints are chat's. It then runs exactly
as that chat request would (the same checks, the same tokens; ``chat_body``). Nothing is stored:
``store`` is answered ``false`` (vLLM's rule when it keeps no responses), and what needs a stored
response or a server-side tool is a 400 naming the parameter: ``previous_response_id``,
``conversation``, ``background``, ``tools``, ``reasoning``, ``include``, ``truncation: "auto"``,
``top_logprobs``, and input items that are not messages or content parts that are not text.
The chat API's own names for the same things (``messages``, ``max_tokens``, ``response_format``,
``n``, ``stream_options``) are refused, naming this API's.

The answer. Whole: a ``response`` whose ``output`` is one assistant message of one
``output_text`` part; ``status`` ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the length ended it; ``usage`` in the API's words (``input_tokens``,
``output_tokens``). Streamed (server-sent events, each ``event: <type>`` with its JSON, numbered by
``sequence_number``): ``response.created``, ``response.in_progress``, the message's
``response.output_item.added`` and its part's ``response.content_part.added``, then one
``response.output_text.delta`` per piece of text, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (or
``response.incomplete``) carrying the whole response. No ``[DONE]``: the API has none. An error
after the stream began is an ``error`` event, then ``response.failed``.

Life cycle: ``app.py`` parses the body, ``chat_body`` makes its chat request, and one
``ResponsesFormat`` formats that request's events for ``run.GenerationResponse``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.types import FinishReason
from router.convert import RequestTimings, Usage
from router.generation import GenerationEvent
from router.openai_api.protocol import ChatCompletionRequest, ResponsesRequest
from router.openai_api.requests import is_one_of, parse

# This API's parameters that need what a stateless server has not (a stored response, a
# server-side tool, reasoning items), with the values that ask for nothing.
NOT_SERVED: dict[str, tuple] = {
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False), "reasoning": (None,),
    "include": (None, []), "truncation": (None, "disabled"), "top_logprobs": (None, 0), "tools": (None, []),
}
CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "n": None,
              "stream_options": None, "messages": "input"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# The chat request's fields this body passes on as they are: the sampling parameters, vLLM's
# extras and pdserve's SLO hints (the chat model's own, less the names CHAT_NAMES refuses).
_PASSED = frozenset(ChatCompletionRequest.model_fields) - {"messages", "max_completion_tokens", "logprobs",
                                                           "top_logprobs", "tool_choice", "parallel_tool_calls",
                                                           "tools", *CHAT_NAMES}


def chat_body(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` means; a 400 (``InvalidRequestError``) naming what it cannot be."""
    _refuse_unserved(req)
    body: dict[str, Any] = {name: getattr(req, name) for name in _PASSED & req.model_fields_set}
    body |= req.model_extra or {}   # vLLM's unimplemented extensions: refused by the chat checks, by name
    body["messages"] = _messages(req)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.text is not None and req.text.format is not None:
        body["response_format"] = _response_format(req.text.format)
    return parse(ChatCompletionRequest, body)


def in_our_words(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat check's error about ``chat_body``'s request, naming this API's parameter."""
    return InvalidRequestError(param_of(exc.field), exc.message)


def param_of(chat_param: str) -> str:
    """The chat parameter a check named -> this API's (the messages are ``instructions`` and ``input``)."""
    for chat_name, ours in (("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
                            ("messages", "input")):
        if chat_param == chat_name or chat_param.startswith((chat_name + ".", chat_name + "[")):
            return ours
    return chat_param


def _refuse_unserved(req: ResponsesRequest) -> None:
    for name, no_ops in NOT_SERVED.items():
        if not is_one_of(getattr(req, name), no_ops):
            raise InvalidRequestError(name, f"{name} is not supported by this server's /v1/responses (it stores "
                                      "no responses and runs no server-side tools; tool calling is on "
                                      "/v1/chat/completions); leave it out")
    if req.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice", "names a tool choice but tools are not served on /v1/responses "
                                  "(use /v1/chat/completions for tool calling)")
    sent = req.model_fields_set | set(req.model_extra or {})
    for name, ours in CHAT_NAMES.items():
        if name in sent:
            instead = f"; send {ours}" if ours else ""
            raise InvalidRequestError(name, f"{name} is a chat completions parameter, not one of /v1/responses{instead}")


def _messages(req: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if item.type != "message":
            raise InvalidRequestError(f"input[{i}].type", f"{item.type!r} items are not served (only messages: "
                                      "no stored tool calls or their outputs)")
        if item.role is None:
            raise InvalidRequestError(f"input[{i}].role", "a message needs a role")
        messages.append({"role": item.role, "content": _content(item.content, i)})
    return messages


def _content(content, i: int) -> str | list[dict] | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequestError(f"input[{i}].content[{j}]", f"{part.type!r} parts are not served "
                                      "(text only: input_text, or output_text in an assistant turn)")
        parts.append({"type": "text", "text": part.text})
    return parts


def _response_format(fmt) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


SENT_AS = {"sampling.max_tokens": "max_output_tokens", "sampling.structured_output": "text.format",
           "chat": "input", "prompt": "input"}   # field paths -> this API's names (``requests.param_for``)


def event_frame(kind: str, data: dict) -> bytes:
    """One server-sent event of this API: its type named twice, as OpenAI sends them."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@dataclass(slots=True)
class ResponsesFormat:
    """One Responses API request's answer, whole or streamed (``run.GenerationResponse``'s format)."""

    response_id: str
    model: str
    req: ResponsesRequest
    created: int = field(default_factory=lambda: int(time.time()))
    chat: bool = True    # errors name parameters as the chat path would, less ``SENT_AS``
    _sequence: int = 0
    _text: list[str] = field(default_factory=list)

    @property
    def message_id(self) -> str:
        return "msg_" + self.response_id.removeprefix("resp_")

    # ---- whole ---------------------------------------------------------------------------
    def whole(self, events: Sequence[GenerationEvent]) -> dict:
        last = events[-1]
        return self._response("".join(e.text for e in events), last.delta.finish_reason, last.usage, last.timings)

    def combine(self, wholes: Sequence[dict], usages: Sequence[Usage | None], choices_per_prompt: int) -> dict:
        return wholes[0]   # one generation: this API has no n

    # ---- streamed --------------------------------------------------------------------------
    def stream_head(self) -> bytes:
        pending = self._response("", None, None)
        item = self._item("", "in_progress")
        return (self._event("response.created", {"response": pending})
                + self._event("response.in_progress", {"response": pending})
                + self._event("response.output_item.added", {"output_index": 0, "item": item})
                + self._event("response.content_part.added", self._part_at() | {"part": _text_part("")}))

    def stream_event(self, event: GenerationEvent) -> bytes:
        if not event.text:
            return b""
        self._text.append(event.text)
        return self._event("response.output_text.delta", self._part_at() | {"delta": event.text, "logprobs": []})

    def stream_tail(self, last: GenerationEvent | None, usage: Usage | None) -> bytes:
        text = "".join(self._text)
        reason = last.delta.finish_reason if last is not None else None
        done = self._response(text, reason, usage, last.timings if last is not None else None)
        item = done["output"][0]
        return (self._event("response.output_text.done", self._part_at() | {"text": text, "logprobs": []})
                + self._event("response.content_part.done", self._part_at() | {"part": _text_part(text)})
                + self._event("response.output_item.done", {"output_index": 0, "item": item})
                + self._event(f"response.{done['status']}", {"response": done}))

    def stream_error(self, body: dict) -> bytes:
        err = body.get("error", {})
        failed = self._response("".join(self._text), None, None) | {
            "status": "failed", "error": {"code": "server_error", "message": err.get("message", "")}}   # the API's one code for it
        return (self._event("error", {"code": err.get("code"), "message": err.get("message", ""),
                                      "param": err.get("param")})
                + self._event("response.failed", {"response": failed}))

    # ---- pieces ----------------------------------------------------------------------------
    def _event(self, kind: str, data: dict) -> bytes:
        frame = event_frame(kind, {"type": kind, "sequence_number": self._sequence} | data)
        self._sequence += 1
        return frame

    def _part_at(self) -> dict:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _item(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [_text_part(text)] if status != "in_progress" else []}

    def _response(self, text: str, reason: FinishReason | None, usage: Usage | None,
                  timings: RequestTimings | None = None) -> dict:
        status = _STATUS.get(reason, "in_progress")
        req = self.req
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": [self._item(text, status)] if reason is not None else [],
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": _format_json(req)}, "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": [], "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
            "usage": _usage(usage, timings),
        }


_STATUS = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete", FinishReason.ABORT: "cancelled",
           FinishReason.ERROR: "failed"}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _format_json(req: ResponsesRequest) -> dict:
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _usage(usage: Usage | None, timings: RequestTimings | None) -> dict | None:
    """The API's usage; ``cached_tokens``: the prompt's tokens found in the prefix cache."""
    if usage is None:
        return None
    cached = timings.prefill_cached_tokens if timings is not None else 0
    # ``cache_write_tokens`` (the API's: prompt tokens written to a cache) is not counted here: 0.
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
