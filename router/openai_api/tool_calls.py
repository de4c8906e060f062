"""Tool calling in the chat API, as vLLM serves it: ``tool_choice`` ``"none"``, ``"required"`` or a
named function, the reply held to the tools' JSON schema by the request's structured output
(``engine.grammar``), so it is always a well-formed call; and ``"auto"`` where the server knows
the model's own call syntax.

Life cycle: ``plan(req)`` reads a chat body's ``tools`` and ``tool_choice`` into a ``ToolPlan``
(refusing what cannot be served, naming the parameter); ``requests.chat_request`` turns its
``schema`` into the request's structured output and passes the tools to the chat template;
each choice's ``ToolCallOutput`` then turns the generated text into OpenAI tool calls: whole at
the end (``calls``), or streamed (``feed``): a named call's arguments as they come, each call of
``"required"``'s array as soon as its object closes.

- named: the reply is the function's arguments (its ``parameters`` schema; none: any object);
- required: a JSON array of ``{"name", "parameters"}``, one item per call (``parallel_tool_calls:
  false``: exactly one), each name one of the tools', its parameters that tool's schema (vLLM's
  schema, with no other keys in an item, and ``$defs`` of every tool lifted to the root so
  references resolve);
- none: the tools go to the chat template, the reply is text;
- auto (``tool_choice``'s default when tools are sent): with ``--tool-call-parser`` (vLLM's
  flags), the reply is free text and the parser finds the model's own calls in it
  (``tool_parsers/``; the finish reason is then ``tool_calls``, as vLLM reports it; with
  ``parallel_tool_calls: false`` only the first call goes out, as vLLM sends it); without
  one, refused, as vLLM refuses it: telling a call from text needs the model's call syntax.

Otherwise the finish reason stays the generation's (``stop``, or ``length`` when max_tokens cut
the call short), as vLLM reports it; the text of a required array after its last whole call, when it
was cut short, is returned as the message's content.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError, require
from router.openai_api.tool_parsers import PARSERS, ObjectScan

_ANY_OBJECT = {"type": "object"}   # a function without parameters takes an object all the same


class ToolChoice(enum.Enum):
    NONE = "none"           # the tools are the template's to show; the reply is text
    NAMED = "named"         # the reply is one call of the named function: its arguments
    REQUIRED = "required"   # the reply is one or more calls: an array of {name, parameters}
    AUTO = "auto"           # the reply is text, in which the model's own call syntax is found


@dataclass(frozen=True, slots=True)
class ToolPlan:
    choice: ToolChoice
    name: str | None = None               # NAMED: the function called
    schema: dict[str, Any] | None = None  # the reply's JSON schema (NAMED, REQUIRED)
    parser: str | None = None             # AUTO: the model's call syntax (``tool_parsers.PARSERS``)
    single: bool = False                  # AUTO with ``parallel_tool_calls: false``: calls after the first are dropped


def plan(req, parser: str | None = None) -> ToolPlan | None:
    """The chat body's tool use; None when no tools are in play (``tool_choice`` ``"none"`` or
    ``"auto"`` without tools change nothing: clients that fill in defaults send them).
    ``parser``: the server's ``--tool-call-parser``, without which "auto" is refused."""
    choice = req.tool_choice
    if not req.tools:
        require(choice in (None, "none", "auto") or (choice == "required" and req.tools is not None), "tool_choice",
                "names a tool choice but the request has no tools")
        return None
    functions = {}
    for i, tool in enumerate(req.tools):
        require(tool.function.name not in functions, f"tools[{i}].function.name",
                f"the name {tool.function.name!r} is given to two tools")
        functions[tool.function.name] = tool.function.parameters
    if (choice is None or choice == "auto") and parser is not None:
        return ToolPlan(ToolChoice.AUTO, parser=parser, single=req.parallel_tool_calls is False)
    if choice is None or choice == "auto":
        raise InvalidRequestError("tool_choice", '"auto" (the default with tools) needs a tool-call parser, which '
                                  'this server was started without (--enable-auto-tool-choice --tool-call-parser): '
                                  'send "required" or a named function (the reply is held to the tools\' schema), '
                                  'or "none"')
    if choice == "none":
        return ToolPlan(ToolChoice.NONE)
    if choice == "required":
        return ToolPlan(ToolChoice.REQUIRED, schema=_required_schema(functions, req.parallel_tool_calls))
    name = choice.function.name
    require(name in functions, "tool_choice.function.name", f"no tool named {name!r} among the request's tools")
    return ToolPlan(ToolChoice.NAMED, name, functions[name] or _ANY_OBJECT)


_DEFINITIONS = ("$defs", "definitions")   # where "#/..." references point: 2020-12's name and draft 7's


def _required_schema(functions: dict[str, dict | None], parallel: bool | None) -> dict[str, Any]:
    """Each function's parameters nested in an array item: their definitions move to the root,
    where their ``#/$defs/...`` (or ``#/definitions/...``) references now resolve."""
    defs: dict[str, dict[str, Any]] = {where: {} for where in _DEFINITIONS}
    items = []
    for i, (name, parameters) in enumerate(functions.items()):
        parameters = dict(parameters or _ANY_OBJECT)
        for where in _DEFINITIONS:
            lifted = parameters.pop(where, {})
            require(isinstance(lifted, dict), f"tools[{i}].function.parameters.{where}", "must be an object of schemas")
            for key, value in lifted.items():
                require(defs[where].get(key, value) == value, "tools", f"two tools define {where}.{key} differently")
                defs[where][key] = value
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema | {where: found for where, found in defs.items() if found}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(slots=True)
class ToolCallOutput:
    """One choice's generated text as tool calls (``plan.choice`` NAMED or REQUIRED)."""

    plan: ToolPlan
    called: bool = False      # AUTO: the model made a call (the finish reason is then "tool_calls")
    _sent: int = 0            # streamed calls so far (NAMED: 1 once its head went out)
    _text: str = ""           # REQUIRED: the text so far, scanned for whole calls
    _used: int = 0            # REQUIRED: where the last whole call ended in it
    _scan: ObjectScan = field(default_factory=lambda: ObjectScan(depth=1))   # REQUIRED: the array's items
    _parser: Any = None       # AUTO: ``tool_parsers.PARSERS[plan.parser]()``

    def __post_init__(self) -> None:
        if self.plan.choice is ToolChoice.AUTO:
            self._parser = PARSERS[self.plan.parser]()

    def calls(self, text: str) -> tuple[list[dict[str, Any]], str]:
        """The whole reply's calls (no ``index``: that is a stream's), and its text that is none
        (a required array cut short; AUTO: the text around the calls). Once, on a fresh output."""
        deltas, content = self.feed(text, finished=True)
        return [{key: value for key, value in delta.items() if key != "index"} for delta in deltas], content

    def feed(self, text: str, finished: bool) -> tuple[list[dict[str, Any]], str]:
        """A streamed chunk's tool-call deltas for ``text``, and what to send as content: the
        text after the last whole call of a required array that ended unfinished, so nothing
        generated is lost."""
        if self.plan.choice is ToolChoice.AUTO:
            calls, content = self._parser.feed(text, finished)
            if self.plan.single:   # vLLM's rule: the model may write more; the client gets the first
                calls = calls[:max(0, 1 - self._sent)]
            deltas = [{"index": self._sent + i} | _call(c.name, c.arguments) for i, c in enumerate(calls)]
            self._sent += len(calls)
            self.called = self.called or bool(calls)
            return deltas, content
        if self.plan.choice is ToolChoice.NAMED:
            if self._sent:
                return ([{"index": 0, "function": {"arguments": text}}] if text else []), ""
            if not text and not finished:
                return [], ""
            self._sent = 1
            return [{"index": 0} | _call(self.plan.name, text)], ""
        start = len(self._text)
        self._text += text
        deltas = []
        for begin, end in self._scan.items(self._text, start):
            item = json.loads(self._text[begin:end])
            deltas.append({"index": self._sent} | _call(item["name"], _arguments_text(item["parameters"])))
            self._sent += 1
            self._used = end
        left = self._text[self._used:] if finished and not self._scan.closed else ""
        return deltas, left


def _arguments_text(parameters: Any) -> str:
    return json.dumps(parameters, ensure_ascii=False)
