"""``GenerationEvent``s -> OpenAI response bodies: whole (``chat.completion``,
``text_completion``) or streamed chunk by chunk (``chat.completion.chunk``; completions stream
``text_completion`` objects), with OpenAI's logprobs shapes.

The first chat chunk carries ``role: assistant``; the finishing event's chunk carries the
finish reason; a reply held to a tool call (``tool_calls.py``) is sent as ``tool_calls``, whole
or as deltas, in place of the content; with ``stream_options.include_usage`` every chunk has ``usage: null`` and one
last chunk with no choices carries the usage. A logprob entry's ``token`` is the token's own
text (``token_id:<id>`` when the model has no tokenizer, vLLM's spelling); its ``bytes`` are the
token's own bytes (``token_bytes.py``), which join into whole characters where text alone cannot. Chat: each token's
entry lists the position's ``top_logprobs`` (N most likely, most likely first; empty for N = 0).
Completions: each position's ``top_logprobs`` maps token text to logprob for the N most likely
and the sampled token (OpenAI: "the logprob of the sampled token is always returned", so up to
N + 1 entries).
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import FinishReason, PromptLogprobs, TopLogprobs
from router.convert import Usage
from router.generation import GenerationEvent
from router.openai_api.token_bytes import TokenBytes
from router.openai_api.tool_calls import ToolCallOutput, ToolChoice, ToolPlan

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
           FinishReason.ERROR: "error"}


def sse(data: dict | str) -> bytes:
    """One server-sent event of the chat and completions streams: a JSON chunk, or ``[DONE]``."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def usage_total(usages: Sequence[Usage | None], choices_per_prompt: int = 1) -> Usage | None:
    """One request's usage over its choices (in index order, ``choices_per_prompt`` for each prompt
    of a batch; None: a choice with none yet): each prompt's tokens once, every choice's completion tokens."""
    if all(u is None for u in usages):
        return None
    prompt_tokens = 0
    for start in range(0, len(usages), choices_per_prompt):
        known = [u for u in usages[start:start + choices_per_prompt] if u is not None]
        prompt_tokens += known[0].prompt_tokens if known else 0
    return Usage(prompt_tokens, sum(u.completion_tokens for u in usages if u is not None))


def whole_of_choices(wholes: Sequence[dict], usages: Sequence[Usage | None], choices_per_prompt: int = 1) -> dict:
    """Each choice's ``ResponseFormat.whole`` as one body: their choices in order, the total usage."""
    usage = usage_total(usages, choices_per_prompt)
    return wholes[0] | {"choices": [w["choices"][0] for w in wholes], "usage": usage_json(usage)}


def usage_json(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


@dataclass(slots=True)
class ResponseFormat:
    """One request's response shape. ``chat``: the chat API, else completions."""

    chat: bool
    response_id: str
    model: str
    logprobs: bool = False
    index: int = 0   # the choice this formats (n > 1: one ResponseFormat per choice, same id)
    include_usage: bool = False
    tokenizer: Any | None = None
    token_bytes: TokenBytes | None = None   # the tokenizer's; made from it when not given
    created: int = field(default_factory=lambda: int(time.time()))
    echo: str | None = None   # completions' ``echo``: the prompt's text, put before the completion's
    prompt_logprobs: bool = False   # vLLM's ``prompt_logprobs`` asked (echo asks the engine for them too)
    tools: ToolPlan | None = None   # chat: the reply is tool calls (NAMED, REQUIRED), not text
    _calls: ToolCallOutput | None = None   # this choice's tool calls, as its text arrives
    _echo_sent: bool = False
    _role_sent: bool = False
    _num_chars: int = 0   # characters the tokens so far complete (``text_offset``)
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def __post_init__(self) -> None:
        if self.logprobs and self.token_bytes is None:
            self.token_bytes = TokenBytes(self.tokenizer)
        if self.tools is not None and self.tools.choice is not ToolChoice.NONE:
            self._calls = ToolCallOutput(self.tools)

    def for_choice(self, index: int, echo: str | None) -> ResponseFormat:
        """The same response's formatter for choice ``index`` (its prompt's ``echo``): its own role,
        text and offset state."""
        return ResponseFormat(self.chat, self.response_id, self.model, self.logprobs, index, self.include_usage,
                              self.tokenizer, self.token_bytes, self.created, echo, self.prompt_logprobs, self.tools)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    # ---- streamed ------------------------------------------------------------------------
    def chunk(self, event: GenerationEvent) -> dict | None:
        """The chunk for one event; None when it has nothing to tell (text held back, no logprobs)."""
        delta = event.delta
        message = self._delta_message(event.text, delta.finished) if self.chat else {"content": event.text}
        finish = self._finish(delta.finish_reason) if delta.finished else None
        if not any(message.values()) and finish is None and not self.logprobs and self._role_sent:
            return None
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = message if self._role_sent else {"role": "assistant"} | message
            self._role_sent = True
            choice["logprobs"] = (self._logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs)
                                  if self.logprobs else None)
        else:
            choice["text"], choice["logprobs"] = self._completion(event.text, delta.prompt_logprobs, delta.token_ids,
                                                                  delta.logprobs, delta.top_logprobs)
        choice["finish_reason"] = finish
        choice["stop_reason"] = event.stop_reason   # vLLM's: the stop string or token id; None otherwise
        out = self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def _delta_message(self, text: str, finished: bool) -> dict[str, Any]:
        """A chat chunk's ``delta`` beside the role: the text, or tool calls (``tool_calls.py``)."""
        if self._calls is None:
            return {"content": text}
        calls, content = self._calls.feed(text, finished)
        return ({"tool_calls": calls} if calls else {}) | ({"content": content} if content else {})

    def _finish(self, reason: FinishReason | None) -> str | None:
        """OpenAI's finish reason; ``tool_calls`` where "auto" found calls (vLLM's rule)."""
        called = self._calls is not None and self._calls.called
        return "tool_calls" if called and reason in (FinishReason.STOP, FinishReason.LENGTH) else _FINISH.get(reason)

    def usage_chunk(self, usage: Usage | None) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage_json(usage)}

    # What ``run.GenerationResponse`` writes of a stream (the Responses API frames its own:
    # ``responses_api.ResponsesFormat``): nothing before the first chunk, a chunk per event,
    # the usage chunk (``include_usage``) and ``[DONE]`` at the end, an error as one chunk.
    def stream_head(self) -> bytes:
        return b""

    def stream_event(self, event: GenerationEvent) -> bytes:
        chunk = self.chunk(event)
        return sse(chunk) if chunk is not None else b""

    def stream_tail(self, last: GenerationEvent | None, usage: Usage | None) -> bytes:
        return (sse(self.usage_chunk(usage)) if self.include_usage and last is not None else b"") + sse("[DONE]")

    def stream_error(self, body: dict) -> bytes:
        return sse(body) + sse("[DONE]")

    def combine(self, wholes: Sequence[dict], usages: Sequence[Usage | None], choices_per_prompt: int) -> dict:
        """The response body of every choice's ``whole`` (``whole_of_choices``)."""
        return whole_of_choices(wholes, usages, choices_per_prompt)

    # ---- whole -----------------------------------------------------------------------------
    def whole(self, events: Sequence[GenerationEvent]) -> dict:
        text = "".join(e.text for e in events)
        last = events[-1]
        token_ids = [t for e in events for t in e.delta.token_ids]
        lps = [lp for e in events for lp in (e.delta.logprobs or ())]
        tops = [top for e in events for top in (e.delta.top_logprobs or ())]
        choice: dict[str, Any] = {"index": self.index}
        prompt = events[0].delta.prompt_logprobs
        if self.chat:
            choice["message"] = self._message(text)
            choice["logprobs"] = self._logprobs(token_ids, lps, tops) if self.logprobs else None
        else:
            choice["text"], choice["logprobs"] = self._completion(text, prompt, token_ids, lps, tops)
        choice["finish_reason"] = self._finish(last.delta.finish_reason)
        choice["stop_reason"] = last.stop_reason
        body = self._head(self._object) | {"choices": [choice], "usage": usage_json(last.usage)}
        if self.prompt_logprobs and prompt is not None:   # vLLM's place: the chat response's, each choice's
            (body if self.chat else choice)["prompt_logprobs"] = self._prompt_logprobs(prompt)
        return body

    def _message(self, text: str) -> dict[str, Any]:
        """The whole reply as a chat message: its text, or its tool calls (content "", as vLLM
        sends it; a required array cut short keeps its unfinished text as content)."""
        if self._calls is None:
            return {"role": "assistant", "content": text}
        calls, content = self._calls.calls(text)
        return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})

    def _completion(self, text: str, prompt: PromptLogprobs | None, token_ids: Sequence[int],
                    logprobs: Sequence[float] | None, tops: Sequence[TopLogprobs] | None) -> tuple[str, dict | None]:
        """A completion's text and ``logprobs``, the echoed prompt's before them the first time
        (``echo``: the whole body, or a stream's first chunk)."""
        echo = None
        if self.echo is not None and not self._echo_sent:
            echo, self._echo_sent = self.echo, True
        echoed = self._echoed_logprobs(prompt) if echo is not None and self.logprobs and prompt else None
        output = self._logprobs(token_ids, logprobs, tops) if self.logprobs else None
        if echoed is not None:
            output = {key: echoed[key] + output[key] for key in output}
        return (text if echo is None else echo + text), output

    # ---- logprobs --------------------------------------------------------------------------
    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                  tops: Sequence[TopLogprobs] | None) -> dict:
        tokens = [self._token_text(t) for t in token_ids]
        values = [_json_logprob(v) for v in logprobs or ()]
        tops = [[(i, _json_logprob(v)) for i, v in top] for top in tops] if tops else [()] * len(tokens)
        if self.chat:
            return {"content": [self._entry(t, lp) | {"top_logprobs": [self._entry(i, v) for i, v in top]}
                                for t, lp, top in zip(token_ids, values, tops)]}
        top_maps = [{self._token_text(t): v for t, v in top} | {tok: lp} for tok, lp, top in zip(tokens, values, tops)]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_maps,
                "text_offset": self._text_offsets(token_ids, tokens)}

    def _echoed_logprobs(self, prompt: PromptLogprobs) -> dict:
        """Completions' ``echo`` with ``logprobs``: the prompt's tokens in OpenAI's shape, the
        first with no logprob (null) and no top map, as the legacy API gives them."""
        tokens = [self._token_text(t) for t in prompt.token_ids]
        values = [_json_logprob(v) for v in prompt.logprobs]
        tops = prompt.top or [()] * len(values)
        top_maps = [{self._token_text(t): _json_logprob(v) for t, v in top} | {tok: lp}
                    for tok, lp, top in zip(tokens[1:], values, tops)]
        return {"tokens": tokens, "token_logprobs": [None, *values], "top_logprobs": [None, *top_maps],
                "text_offset": self._text_offsets(prompt.token_ids, tokens)}

    def _prompt_logprobs(self, prompt: PromptLogprobs) -> list[dict | None]:
        """vLLM's shape: None for the first prompt token, then per token a map from token id to
        its logprob, rank and text: the prompt token's own entry, then the position's N most likely."""
        out: list[dict | None] = [None]
        tops = prompt.top or [()] * len(prompt.logprobs)
        for token_id, logprob, rank, top in zip(prompt.token_ids[1:], prompt.logprobs, prompt.ranks, tops):
            entries = {str(token_id): self._ranked(token_id, logprob, rank)}
            for i, (t, v) in enumerate(top):
                entries.setdefault(str(t), self._ranked(t, v, i + 1))
            out.append(entries)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": _json_logprob(logprob), "rank": rank, "decoded_token": self._token_text(token_id)}

    def _text_offsets(self, token_ids: Sequence[int], tokens: Sequence[str]) -> list[int]:
        """Where each token starts in the completion's text, counted across the whole response
        (a streamed chunk's continue from the text already sent: vLLM's ``initial_text_offset``).
        Counted in the characters the tokens' bytes complete, not in their texts' lengths: a
        token inside a character (byte-level BPE spells an emoji in several) decodes alone to
        U+FFFD, and adding those up (vLLM's rule) pushes every later offset past its token; here
        it points at its character's start."""
        offsets = []
        for token_id, text in zip(token_ids, tokens):
            offsets.append(self._num_chars)
            self._num_chars += len(self._utf8.decode(self.token_bytes(token_id, text)))
        return offsets

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(self.token_bytes(token_id, text))}

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        if self.token_bytes is None:   # made on first use: prompt logprobs without logprobs
            self.token_bytes = TokenBytes(self.tokenizer)
        return self.token_bytes.text(token_id, self.tokenizer.decode([token_id], skip_special_tokens=False))


LOWEST_LOGPROB = -9999.0   # vLLM's floor for the same reason


def _json_logprob(value: float) -> float:
    """A log-probability JSON can carry: a token the model rules out (logit -inf) has -inf, which
    Python's json writes as -Infinity, a literal JSON parsers refuse; floored instead."""
    return max(value, LOWEST_LOGPROB)
