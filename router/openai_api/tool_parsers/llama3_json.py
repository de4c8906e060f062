"""``llama3_json`` (Llama 3.1+ JSON tool calling): the reply is ``{"name": ..., "parameters": {...}}``
(``arguments`` taken too), optionally after ``<|python_tag|>``, several separated by ``;``; a reply
that does not begin so is text, and so is everything from a call that does not parse on."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from router.openai_api.tool_parsers.common import ObjectScan, ParsedCall, json_call


class _Reply(enum.Enum):
    """What a llama3_json reply is, as far as its text so far tells."""

    UNDECIDED = "undecided"   # only blanks (or the start of <|python_tag|>) so far
    CALLS = "calls"           # it began with ``{`` or the tag: calls, as long as they parse
    TEXT = "text"             # anything else, or a call that did not parse: content


@dataclass(slots=True)
class Llama3JsonParser:
    TAG = "<|python_tag|>"
    keeps_special_tokens = False

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
            call = json_call(self._pending[begin:end]) if not between.strip(" \t\n;") else None
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
