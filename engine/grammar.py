"""Structured output (vLLM's ``structured_outputs``, OpenAI's ``response_format``) on llguidance:
a request's ``StructuredOutput`` made into llguidance's grammar, checked, and matched token by
token against what the request has output, giving the set of tokens allowed next.

Torch-free (the router checks grammars at its edge with llguidance's compiler, as the engine does). The
engine's ``Grammars`` holds the model's tokenizer in llguidance's form (built on the first
structured request, ~0.3 s for a 49,152-token vocabulary) and makes each request's
``GrammarMatcher`` when the request is added, its compile on a thread of its own (a few
milliseconds for common schemas, ~50 ms for the largest the router lets through: 64 Ki
characters, ``--max-structured-output-chars``): the step loop never waits for it; the scheduler
computes the request's prompt but its last token until the matcher is ready (vLLM's
WAITING_FOR_FSM, without a state of its own). A matcher is a cache of the request's tokens, not
state of its own: before each mask it consumes the output tokens it has not seen, so the first
token a prefill worker chose, the tokens a migrated request streamed before it moved and a
request recomputed after preemption all land it where one engine would have; tokens it holds
but the request no longer does (never, today) reset it. It dies with its ``Request``. A step's
masks are computed in one llguidance call for all its guided rows (``allowed_rows``).

Life cycle of a constrained request: the router checks the grammar (``check``) -> the engine
starts its compile on ``add_request`` (text that is no grammar at all is refused there, nothing
held; one the compiler refuses fails the request at its first sampling, naming the field) -> every step that samples the
request, ``sync`` then ``allowed_rows`` give its mask (EOS only where the output is a whole match; only EOS once
the grammar can take nothing more) -> the request finishes on EOS, a stop, its length or a
failure like any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np

from engine.errors import InvalidRequestError
from engine.types import GuideKind, StructuredOutput

FIELD = "structured_output"


class GrammarError(RuntimeError):
    """A request's output cannot go on in its grammar; the message is for its client."""


def grammar_of(output: StructuredOutput, field: str = FIELD) -> str:
    """llguidance's grammar text for ``output``; InvalidRequestError naming ``field`` where the
    text is not even a schema, a list of choices or a grammar (llguidance's compiler checks the rest:
    ``check`` at the router, the matcher's construction on a worker)."""
    try:
        return _compile(output)
    except (ValueError, TypeError, RuntimeError) as exc:   # llguidance's for text it cannot parse
        raise InvalidRequestError(field, _reason(output, str(exc))) from None


def check(output: StructuredOutput, field: str = FIELD) -> None:
    """The router's check before any worker sees the request: what llguidance's compiler says of
    the grammar (no tokenizer needed); a worker's matcher then compiles it once more, for its vocabulary."""
    error = llguidance.LLMatcher.validate_grammar(grammar_of(output, field))
    if error:
        raise InvalidRequestError(field, _reason(output, error))


def _reason(output: StructuredOutput, error: str) -> str:
    return f"{output.kind.value}: {error.strip()[:1000]}"


def _compile(output: StructuredOutput) -> str:
    if output.kind is GuideKind.JSON_OBJECT:
        if output.spec:
            raise ValueError("takes no spec")
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if not output.spec:
        raise ValueError("the spec is empty")
    if output.kind is GuideKind.JSON:
        schema = json.loads(output.spec)
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object (or true / false)")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if output.kind is GuideKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(output.spec)
    if output.kind is GuideKind.CHOICE:
        choices = json.loads(output.spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("choices are a non-empty list of non-empty strings")
        # One lexeme (a regex alternation), not a grammar rule per choice: the parser takes at
        # most 2,000 items in a row, so 2,000 choices failed at the first token (found by a
        # probe, as "the output left its grammar"); the lexer's DFA takes any number, and faster.
        return llguidance.LLMatcher.grammar_from_regex("(?:" + "|".join(map(_literal, choices)) + ")")
    return llguidance.grammar_from("grammar", output.spec)   # Lark, or GBNF converted to Lark


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")   # what Rust's regex syntax (llguidance's) gives a meaning


def _literal(text: str) -> str:
    """``text`` as a regex matching exactly it."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choices_spec(choices: Sequence[str]) -> str:
    """A CHOICE spec from its strings (how the router and tests write one)."""
    return json.dumps(list(choices))


class GrammarMatcher:
    """One request's position in its grammar, synced to the request's output tokens. Its
    llguidance matcher is compiled on ``Grammars``' thread: ``ready`` says whether it is there
    (the scheduler samples no request before: it computes the prompt but its last token)."""

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self._consumed = 0   # output tokens the matcher has taken

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def _matcher(self) -> llguidance.LLMatcher:
        return self._compiled.result()   # waits only where a caller samples a request not ready

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Take the tokens of ``output_token_ids`` (the request's whole output so far) not taken
        yet. Raises GrammarError where the output left the grammar (a token chosen without its
        mask) or llguidance gave up (its parser limits)."""
        if self._consumed > len(output_token_ids):
            self._matcher.reset()
            self._consumed = 0
        new = list(output_token_ids[self._consumed:])
        if new and not self._matcher.consume_tokens(new):
            raise GrammarError(f"the output left its grammar: {self._error()}")
        self._consumed = len(output_token_ids)
        self.check()

    def check(self) -> None:
        """A grammar the compiler refused (the router refuses those before any worker sees them),
        or one past llguidance's parser limits: GrammarError with its reason."""
        if self._matcher.is_error():
            raise GrammarError(f"the grammar cannot go on: {self._error()}")

    def _error(self) -> str:
        """llguidance's reason, without the parser state it appends (``<state>``: tens of lines
        of lexer internals, meaningless to a client and noise in the worker's log)."""
        return self._matcher.get_error().split("<state>", 1)[0].strip()[:1000] or "unknown"


def allowed_rows(matchers: Sequence[GrammarMatcher], vocab_size: int, num_threads: int) -> np.ndarray:
    """Each (synced) matcher's allowed next tokens, a bool row over the vocabulary: one llguidance
    call for all of them (its executor, on ``num_threads`` threads, the GIL released) and one
    unpacking of the bits, rather than a call and an unpacking a row."""
    words = (vocab_size + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.int32)
    _executor(num_threads).unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)],
                                                   bits.ctypes.data, words * 4, len(matchers))
    for matcher in matchers:   # a grammar past llguidance's limits fails here (its row alone, on a retry)
        matcher.check()
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(bool)


_EXECUTORS: dict[int, llguidance.LLExecutor] = {}


def _executor(num_threads: int) -> llguidance.LLExecutor:
    if num_threads not in _EXECUTORS:
        _EXECUTORS[num_threads] = llguidance.LLExecutor(num_threads=max(1, num_threads))
    return _EXECUTORS[num_threads]


class Grammars:
    """The model's tokenizer as llguidance reads it, and a matcher for each constrained request,
    compiled on a thread of its own (llguidance drops the GIL while it compiles). ``on_compiled``:
    called (from that thread) as each compile ends: the engine loop's wake-up."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiler: ThreadPoolExecutor | None = None   # made on the first guided request
        self.on_compiled: Callable[[], None] | None = None

    def matcher(self, output: StructuredOutput) -> GrammarMatcher:
        """A matcher at the grammar's start, its compile under way. Raises InvalidRequestError
        at once where the model has no tokenizer or the text is no grammar at all
        (``grammar_of``); the compiler's own verdict comes with the matcher (``check``)."""
        if self._tokenizer is None:
            raise InvalidRequestError(FIELD, "this model has no tokenizer to match a grammar's text against")
        grammar = grammar_of(output)
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        compiled = self._compiler.submit(self._compile, grammar)
        if self.on_compiled is not None:
            on_compiled = self.on_compiled
            compiled.add_done_callback(lambda _: on_compiled())
        return GrammarMatcher(compiled)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self._tokenizer_for_llguidance(), grammar, log_level=0)

    def _tokenizer_for_llguidance(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:   # the compile thread's alone
            import llguidance.hf   # transformers: only where a structured request arrives

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size,
                                                              eos_token=self._eos_token_ids or None)
        return self._ll_tokenizer
