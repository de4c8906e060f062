"""What every tool-call syntax shares: the call found (``ParsedCall``), the ``{"name", "arguments"}``
object read as one, how much of a text's tail to hold back while it could begin a tag, and the
linear, string-aware scan that finds where each JSON object of a growing text ends."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str   # a JSON object's text


def parsed_call(obj: object) -> ParsedCall | None:
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


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (kept until the next feed)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def json_call(body: str) -> ParsedCall | None:
    try:
        return parsed_call(json.loads(body))
    except (ValueError, RecursionError):
        return None


@dataclass(slots=True)
class ObjectScan:
    """Finds JSON objects at ``depth`` (0: top-level values, 1: an array's items) as a text grows:
    where each begins and ends, strings and their escapes skipped; each character is read once,
    so a long reply fed token by token costs linear time. ``closed``: the enclosing value ended
    (``end``: just after its closing bracket). ``stray``: where an array's first item that is no
    object begins (depth 1; -1: none so far)."""

    depth: int = 0
    _level: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _start: int = -1
    closed: bool = False
    end: int = -1
    stray: int = -1

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
            elif self._level == self.depth and self.depth and ch not in "{ \t\r\n,]":
                if self.stray < 0 and not self.closed:
                    self.stray = i
                self._in_string = ch == '"'
                self._level += ch == "["
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
                elif self._level < self.depth and not self.closed:
                    self.closed, self.end = True, i + 1
        return found

    def rebase(self, cut: int) -> None:
        """The text's first ``cut`` characters were dropped: an object begun keeps its place."""
        if self._start >= 0:
            self._start -= cut
        if self.end >= 0:
            self.end -= cut
        if self.stray >= 0:
            self.stray -= cut
