"""``mistral`` (Mistral 7B v0.3, Mixtral 8x22B, Mistral Small / Nemo / Large): the calls follow the
``[TOOL_CALLS]`` token, which is a special token: the chat request keeps special tokens in the
reply (``keeps_special_tokens``) unless the client decided. Two forms, as vLLM reads them:

- the JSON array of tokenizers before v11: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
- v11 and later: ``[TOOL_CALLS]name[ARGS]{...}``, once per call (``[ARGS]`` may be missing).

Text before the first ``[TOOL_CALLS]`` is content; text after a call is dropped; a call that does
not parse stays in the content as written (with its ``[TOOL_CALLS]``), and so does the rest of
the reply after it.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

from router.openai_api.tool_parsers.common import ObjectScan, ParsedCall, held_back, json_call

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_NAME_MAX_CHARS = 256   # past this without its arguments' "{" the text is no call's name


class _At(enum.Enum):
    """Where the parser is in the reply."""

    TEXT = "text"             # looking for [TOOL_CALLS]
    AFTER_TAG = "after tag"   # just past it: which form follows is not known yet
    ARRAY = "array"           # inside the JSON array form
    NAMED = "named"           # inside name[ARGS]{...}
    GIVEN_UP = "given up"     # a call did not parse: the rest is content as written


@dataclass(slots=True)
class MistralParser:
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    keeps_special_tokens = True

    _pending: str = ""
    _at: _At = _At.TEXT
    _called: bool = False   # a call went out: later text outside calls is dropped
    _scan: ObjectScan = field(default_factory=ObjectScan)
    _scanned: int = 0       # how much of the pending text the scan has read
    _lead: str = ""         # the blanks between the tag and the call (for its text as written)

    def feed(self, text: str, finished: bool) -> tuple[list[ParsedCall], str]:
        self._pending += text
        calls: list[ParsedCall] = []
        content = ""
        while True:
            step = _STEPS[self._at](self, calls, finished)
            if step is None:
                break
            content += step
        if finished and self._pending:   # a call cut short: as the model wrote it
            content += self._outside(self._unparsed())
            self._pending = ""
        return calls, content

    def _text(self, calls, finished: bool) -> str | None:
        start = self._pending.find(self.TAG)
        if start >= 0:
            before, self._pending = self._pending[:start], self._pending[start + len(self.TAG):]
            self._at = _At.AFTER_TAG
            return self._outside(before)
        keep = 0 if finished else held_back(self._pending, self.TAG)
        cut = len(self._pending) - keep
        out, self._pending = self._outside(self._pending[:cut]), self._pending[cut:]
        return out if out else None

    def _after_tag(self, calls, finished: bool) -> str | None:
        head = self._pending.lstrip()
        if not head:
            return None
        self._lead, self._pending, self._scanned = self._pending[:len(self._pending) - len(head)], head, 0
        if head[0] == "[":
            self._at, self._scan = _At.ARRAY, ObjectScan(depth=1)
        else:
            self._at, self._scan = _At.NAMED, ObjectScan(depth=0)
        return ""

    def _array(self, calls, finished: bool) -> str | None:
        """Each object of the array as a call, in order, up to the first item that is none (a
        string, a number, an object that is no call: from there on it gives up); an array
        without a call is no call either."""
        scan = self._scan
        for begin, end in scan.items(self._pending, self._scanned):
            if (scan.closed and begin >= scan.end) or 0 <= scan.stray < begin:
                break
            call = json_call(self._pending[begin:end])
            if call is None:
                return self._give_up()
            calls.append(call)
            self._called = True
        self._scanned = len(self._pending)
        if scan.stray >= 0 or (scan.closed and not self._called):
            return self._give_up()
        if not scan.closed:
            return None
        self._pending, self._at = self._pending[scan.end:], _At.TEXT
        return ""

    def _named(self, calls, finished: bool) -> str | None:
        brace = self._pending.find("{")
        name_part = self._pending if brace < 0 else self._pending[:brace]
        name = name_part.strip().removesuffix(self.ARGS).strip()
        if len(name_part) > _NAME_MAX_CHARS:   # whether its "{" has come or not: a stream and a body agree
            return self._give_up()
        if brace < 0:
            return None if not name or _NAME.fullmatch(name.split("[")[0]) else self._give_up()
        if not _NAME.fullmatch(name):
            return self._give_up()
        found = self._scan.items(self._pending, max(self._scanned, brace))
        self._scanned = len(self._pending)
        if not found:
            return None
        begin, end = found[0]
        try:
            arguments = json.loads(self._pending[begin:end])
        except (ValueError, RecursionError):
            return self._give_up()
        if not isinstance(arguments, dict):
            return self._give_up()
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        self._called = True
        self._pending, self._at = self._pending[end:], _At.TEXT
        return ""

    def _given_up(self, calls, finished: bool) -> str | None:
        out, self._pending = self._outside(self._pending), ""
        return out if out else None

    def _give_up(self) -> str:
        out = self._outside(self._unparsed())
        self._at, self._pending = _At.GIVEN_UP, ""
        return out

    def _unparsed(self) -> str:
        """The pending text as the model wrote it (a call's text with its tag)."""
        if self._at is _At.AFTER_TAG:
            return self.TAG + self._pending
        return self.TAG + self._lead + self._pending if self._at in (_At.ARRAY, _At.NAMED) else self._pending

    def _outside(self, text: str) -> str:
        return "" if self._called else text


_STEPS = {_At.TEXT: MistralParser._text, _At.AFTER_TAG: MistralParser._after_tag, _At.ARRAY: MistralParser._array,
          _At.NAMED: MistralParser._named, _At.GIVEN_UP: MistralParser._given_up}
