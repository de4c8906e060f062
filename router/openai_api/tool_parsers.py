"""Tool-call syntaxes of the models that emit their own calls, for ``tool_choice: "auto"`` (vLLM's
``--tool-call-parser``): the reply is free text, and these find the calls in it.

Life cycle: one parser per choice of a reply (``tool_calls.ToolCallOutput`` makes it), fed the
reply's text as it arrives (``feed``): each call is returned once it is complete, and the text
around the calls as content, held back only while it could still be the start of a call. The
whole reply is the same feed, finished at once, so a stream and a body always agree.

- ``hermes`` (Hermes 2 Pro and later, Qwen 2.5 / 3, and the many templates that copied them):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before them;
- ``llama3_json`` (Llama 3.1+ JSON tool calling): the reply is ``{"name": ..., "parameters":
  {...}}`` (``arguments`` taken too), optionally after ``<|python_tag|>``, several separated by
  ``;``; a reply that does not begin so is text.

A call that does not parse (bad JSON, no name) is left in the content as the model wrote it,
so nothing generated is lost; text after the first call is dropped, as vLLM drops it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str   # a JSON object's text


def _parsed(obj: object) -> ParsedCall | None:
    """``{"name", "arguments" | "parameters"}`` as a call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):   # some models write the object's text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (kept until the next feed)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class HermesParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    _pending: str = ""
    _inside: bool = False
    _called: bool = False   # a call went out: later text outside calls is dropped

    def feed(self, text: str, finished: bool) -> tuple[list[ParsedCall], str]:
        self._pending += text
        calls, content = [], ""
        while True:
            if self._inside:
                end = self._pending.find(self.CLOSE)
                if end < 0 and not finished:
                    break
                body = self._pending if end < 0 else self._pending[:end]
                self._pending = "" if end < 0 else self._pending[end + len(self.CLOSE):]
                self._inside = False
                call = _json_call(body)
                if call is None:
                    content += self._outside(self.OPEN + body + ("" if end < 0 else self.CLOSE))
                else:
                    calls.append(call)
                    self._called = True
                continue
            start = self._pending.find(self.OPEN)
            if start >= 0:
                content += self._outside(self._pending[:start])
                self._pending, self._inside = self._pending[start + len(self.OPEN):], True
                continue
            keep = 0 if finished else _held_back(self._pending, self.OPEN)
            content += self._outside(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return calls, content

    def _outside(self, text: str) -> str:
        return "" if self._called else text


def _json_call(body: str) -> ParsedCall | None:
    try:
        return _parsed(json.loads(body))
    except (ValueError, RecursionError):
        return None


@dataclass(slots=True)
class ObjectScan:
    """Finds JSON objects at ``depth`` (0: top-level values, 1: an array's items) as a text grows:
    where each begins and ends, strings and their escapes skipped; each character is read once,
    so a long reply fed token by token costs linear time. ``closed``: the enclosing value ended."""

    depth: int = 0
    _level: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _start: int = -1
    closed: bool = False

    def items(self, text: str, start: int) -> list[tuple[int, int]]:
        """The objects that ``text[start:]`` completes, as (begin, end) offsets into ``text``."""
        found = []
        for i in range(start, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                if self._level == self.depth and ch == "{":
                    self._start = i
                self._level += 1
            elif ch in "]}":
                self._level -= 1
                if self._level == self.depth and ch == "}" and self._start >= 0:
                    found.append((self._start, i + 1))
                    self._start = -1
                elif self._level < self.depth:
                    self.closed = True
        return found

    def rebase(self, cut: int) -> None:
        """The text's first ``cut`` characters were dropped: an object begun keeps its place."""
        if self._start >= 0:
            self._start -= cut


class _Reply(enum.Enum):
    """What a llama3_json reply is, as far as its text so far tells."""

    UNDECIDED = "undecided"   # only blanks (or the start of <|python_tag|>) so far
    CALLS = "calls"           # it began with ``{`` or the tag: calls, as long as they parse
    TEXT = "text"             # anything else, or a call that did not parse: content


@dataclass(slots=True)
class Llama3JsonParser:
    TAG = "<|python_tag|>"

    _pending: str = ""
    _reply: _Reply = _Reply.UNDECIDED
    _scan: ObjectScan = field(default_factory=ObjectScan)   # CALLS: the pending text's whole objects
    _scanned: int = 0          # CALLS: how much of the pending text the scan has read

    def feed(self, text: str, finished: bool) -> tuple[list[ParsedCall], str]:
        self._pending += text
        if self._reply is _Reply.UNDECIDED:
            head = self._pending.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self._reply, self._pending = _Reply.CALLS, head.removeprefix(self.TAG)
            elif (head and not self.TAG.startswith(head)) or finished:
                self._reply = _Reply.TEXT
            else:
                return [], ""
        if self._reply is _Reply.TEXT:
            content, self._pending = self._pending, ""
            return [], content
        return self._calls(finished)

    def _calls(self, finished: bool) -> tuple[list[ParsedCall], str]:
        """Each whole ``{...}`` of the pending text as a call (the scan finds where each ends;
        only then is it decoded), separators between them skipped."""
        calls, used = [], 0
        for begin, end in self._scan.items(self._pending, self._scanned):
            between = self._pending[used:begin]
            call = _json_call(self._pending[begin:end]) if not between.strip(" \t\n;") else None
            if call is None:   # text, or an object that is no call: the rest stays as written
                self._reply, content, self._pending = _Reply.TEXT, self._pending[used:], ""
                return calls, content
            calls.append(call)
            used = end
        self._pending, self._scanned = self._pending[used:], len(self._pending) - used
        self._scan.rebase(used)
        if finished and self._pending.strip(" \t\n;"):   # what never became a call stays as the model wrote it
            content, self._pending = self._pending, ""
            return calls, content
        return calls, ""


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
