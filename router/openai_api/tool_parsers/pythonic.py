"""``pythonic`` (Llama 3.2 and 4, ToolACE, and other models that write calls as Python): the reply is
a Python list of calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``
(Llama 4 may wrap it in ``<|python_start|>`` ... ``<|python_end|>``, special tokens dropped unless
kept). Read with ``ast``, never evaluated: every argument must be a literal (``ast.literal_eval``)
that JSON can hold. A reply that does not begin with ``[`` is text; so is a list that is not
one of calls (then the whole reply, as written). Text after the list is dropped, as after a
call in the other syntaxes. The calls go out once the list closes.
"""

from __future__ import annotations

import ast
import enum
import json
from dataclasses import dataclass

from router.openai_api.tool_parsers.common import ParsedCall

_OPEN_TAG = "<|python_start|>"


class _Reply(enum.Enum):
    UNDECIDED = "undecided"   # only blanks (or the start of the opening tag) so far
    CALLS = "calls"           # it began with "[": a list of calls, if it parses
    TEXT = "text"             # content, as written
    DONE = "done"             # the list closed: what follows is dropped


@dataclass(slots=True)
class PythonListScan:
    """Finds where a Python list that opens the text closes, strings skipped (either quote, tripled
    or not, with escapes); each character is read once. A quote whose next two characters have
    not come yet waits for them (``'`` may begin ``'''``), unless the text is finished."""

    _pos: int = 0      # the next character to read
    _level: int = 0
    _quote: str = ""   # the open string's delimiter: ', ", ''' or """
    _escaped: bool = False

    def end(self, text: str, finished: bool) -> int:
        """Just past the list's closing bracket, once ``text`` reaches it; else -1."""
        while self._pos < len(text):
            i, ch = self._pos, text[self._pos]
            undecided = len(text) - i < 3 and not finished
            if self._quote:
                step = self._in_string(text, i, ch, undecided)
                if step == 0:
                    return -1
                self._pos += step
                continue
            if ch in "\"'":
                if undecided:
                    return -1
                self._quote = ch * 3 if text.startswith(ch * 3, i) else ch
                self._pos += len(self._quote)
                continue
            self._pos += 1
            if ch in "[({":
                self._level += 1
            elif ch in "])}":
                self._level -= 1
                if self._level == 0:
                    return self._pos
        return -1

    def _in_string(self, text: str, i: int, ch: str, undecided: bool) -> int:
        """How far to move inside a string (0: wait for more text)."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif text.startswith(self._quote, i):
            step, self._quote = len(self._quote), ""
            return step
        elif len(self._quote) == 3 and ch == self._quote[0] and undecided:
            return 0   # perhaps the closing delimiter, its rest not here yet
        return 1


@dataclass(slots=True)
class PythonicParser:
    keeps_special_tokens = False

    _pending: str = ""
    _reply: _Reply = _Reply.UNDECIDED
    _scan: PythonListScan | None = None
    _lead: str = ""   # CALLS: what came before the list (blanks, the opening tag), for the text as written

    def feed(self, text: str, finished: bool) -> tuple[list[ParsedCall], str]:
        self._pending += text
        if self._reply is _Reply.UNDECIDED:
            self._decide(finished)
        if self._reply is _Reply.TEXT:
            content, self._pending = self._pending, ""
            return [], content
        if self._reply is _Reply.DONE:
            self._pending = ""
        if self._reply is not _Reply.CALLS:
            return [], ""
        return self._list(finished)

    def _decide(self, finished: bool) -> None:
        head = self._pending.lstrip()
        body = head.removeprefix(_OPEN_TAG).lstrip()
        if body.startswith("["):
            self._reply, self._scan = _Reply.CALLS, PythonListScan()
            self._lead, self._pending = self._pending[:len(self._pending) - len(body)], body
        elif (head and not _OPEN_TAG.startswith(head) and body) or finished:
            self._reply = _Reply.TEXT

    def _list(self, finished: bool) -> tuple[list[ParsedCall], str]:
        end = self._scan.end(self._pending, finished)
        if end < 0:
            if not finished:
                return [], ""
            return [], self._as_written()   # cut short
        calls = python_calls(self._pending[:end])
        if calls is None:
            return [], self._as_written()
        self._reply, self._pending = _Reply.DONE, ""
        return calls, ""

    def _as_written(self) -> str:
        self._reply = _Reply.TEXT
        content, self._pending = self._lead + self._pending, ""
        return content


def python_calls(source: str) -> list[ParsedCall] | None:
    """``[f(a=1), g()]`` as calls; None when it is not a list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        name = _dotted_name(node.func) if isinstance(node, ast.Call) and not node.args else None
        arguments = _literal_keywords(node.keywords) if name else None
        if arguments is None:
            return None
        calls.append(ParsedCall(name, arguments))
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return f"{owner}.{node.attr}" if owner else None
    return None


def _literal_keywords(keywords: list[ast.keyword]) -> str | None:
    """The keyword arguments as a JSON object's text; None if one is not a literal JSON can hold."""
    arguments = {}
    for keyword in keywords:
        if keyword.arg is None:   # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
