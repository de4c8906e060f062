"""``hermes`` (Hermes 2 Pro and later, Qwen 2.5 / 3, and the many templates that copied them):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before them. A call
that does not parse stays in the content as written; text after the first call is dropped, as
vLLM drops it."""

from __future__ import annotations

from dataclasses import dataclass

from router.openai_api.tool_parsers.common import ParsedCall, held_back, json_call


@dataclass(slots=True)
class HermesParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    keeps_special_tokens = False

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
                call = json_call(body)
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
            keep = 0 if finished else held_back(self._pending, self.OPEN)
            content += self._outside(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return calls, content

    def _outside(self, text: str) -> str:
        return "" if self._called else text
