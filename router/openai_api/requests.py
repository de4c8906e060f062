"""An OpenAI request body -> pdserve's ``GenerateRequest``, so it runs through exactly the checks
a gRPC request does (``router.limits``, ``router.convert``); and the other way for error
messages: a field path of the ``GenerateRequest`` -> the OpenAI parameter the client wrote.

A completions ``prompt`` may be a batch (a list of texts or of token-id lists): one generation
per prompt and choice, ``index`` = prompt x n + choice, as OpenAI and vLLM number them.
What is refused here (a 400 naming the parameter): ``n`` outside [1, ``MAX_CHOICES``] (each
choice is a generation of its own: ``fan_in.py``), more than ``MAX_GENERATIONS`` prompts x n,
``best_of`` > 1, chat's ``echo``, ``suffix``, a ``logit_bias`` key that is not a token id, a tool
choice ``tool_calls.py`` does not serve, more than one structured output (``response_format``,
vLLM's ``structured_outputs`` or its ``guided_*`` fields, a tool call's schema: each becomes
``sampling.structured_output``), content parts that are not text, and vLLM's extensions this server
does not implement (``NOT_IMPLEMENTED``) unless sent as their no-op value: a vLLM client's
``use_beam_search`` gets an error, not an answer generated without it. The ``developer`` role (OpenAI's
newer name for ``system``) is sent as ``system``: the chat templates know that one. Logprobs as
OpenAI defines them: chat ``logprobs`` with ``top_logprobs`` N, completions ``logprobs`` N (the sampled token's
logprob, plus the N most likely tokens at each position; N <= 20, checked with the gRPC
request's ``sampling.top_logprobs``). A parameter
left out takes the server's default, as over gRPC (temperature: greedy; max_tokens: the
server's ``--default-max-tokens``), so the same request gives the same tokens on both doors.
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from engine.errors import InvalidRequestError
from engine.types import SamplingParams
from engine.validation import check_token_ids
from protos import pdserve_pb2 as pb
from router.openai_api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, TokenizeRequest
from router.openai_api.tool_calls import ToolPlan
from router.openai_api.tool_parsers import PARSERS

_SAMPLING = ("temperature", "top_p", "top_k", "seed", "ignore_eos")
# Sampling fields sent only when not at SamplingParams' default, the value that turns them off
# (a client that fills in every default sends the same request as one that leaves them out).
_UNLESS_OFF = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
               "include_stop_str_in_output")
_OFF = SamplingParams()
MAX_CHOICES = 16   # n: each choice is a live request (max_concurrent_streams counts it too)
MAX_GENERATIONS = 64   # a completions batch: prompts x n live requests from one body
VLLM_ALL_TOKENS = -1   # vLLM's top_k for "no top-k" beside 0; its clients send it as their default
_TOP = ("ttft_ms", "tpot_ms", "priority", "skip_special_tokens")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
_ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the instructions' role
_TYPE_MISMATCH = re.compile(r"\w+_(type|parsing)|string_unicode")   # pydantic's "not a <type>" errors


# vLLM's request extensions that would change what is generated, with the values that change
# nothing (sent by clients that fill in every default). Any other value is refused by name.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1.0,),
    "logits_processors": (),
    "guided_whitespace_pattern": (),
    # what a response carries, or where a prompt comes from / its cache lives: null or the default is a no-op
    "prompt_embeds": (None,), "return_tokens_as_token_ids": (False, None), "return_token_ids": (False, None),
    "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None, {}), "mm_processor_kwargs": (None, {}),
    "spaces_between_special_tokens": (True, None),
}
COMPLETION_NOT_IMPLEMENTED: dict[str, tuple] = {   # a text prompt always gets the tokenizer's special tokens
    "add_special_tokens": (True, None),
}
# vLLM's structured output kinds, as its structured_outputs names them (its guided_* fields add the prefix).
_GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
CHAT_NOT_IMPLEMENTED: dict[str, tuple] = {   # chat's (vLLM's; OpenAI's deprecated functions: send tools; audio)
    "echo": (False,), "chat_template": (), "documents": (), "functions": ([],), "function_call": ("none", "auto"),
    "modalities": (["text"],), "audio": (), "reasoning_effort": (None,),
    "add_special_tokens": (False, None),   # the chat template places the special tokens
}


def _refuse_extensions(req, table: dict[str, tuple]) -> None:
    extra = req.model_extra or {}
    for name, no_ops in table.items():
        if name in extra:
            _refuse(is_one_of(extra[name], no_ops), name, f"{name} is not supported by this server; leave it out")


def is_one_of(value: object, no_ops: tuple) -> bool:
    """Equal to one of ``no_ops``, a JSON true / false never standing in for 1 / 0."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_ops)


def _refuse(ok: object, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(param, message)


def parse(model: type, body: object):
    """The body as ``model``; a validation error is a 400 naming the first bad parameter."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = _meant(exc.errors())
        raise InvalidRequestError(_loc(err["loc"]) or "body", err["msg"]) from None


def _meant(errs: list) -> dict:
    """The error to report. pydantic tries every member of a union (``prompt``: a string, ids,
    strings, lists of ids) and reports each; the member the value was meant for is the one that
    got past the type test (a bound, a missing key, a bad string), so that error names the
    parameter and says what is wrong, not "Input should be a valid string"."""
    return next((e for e in errs if not _TYPE_MISMATCH.fullmatch(e["type"])), errs[0])


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif not re.fullmatch(r"\w+", str(part)) or part in _TYPE_TAGS:
            continue   # pydantic names the union member it tried ("str", "list[int]"): not a parameter
        else:
            out += f".{part}"
    return out


def chat_request(req: ChatCompletionRequest, label: str | None, tools: ToolPlan | None = None) -> pb.GenerateRequest:
    """``tools``: the body's ``tool_calls.plan``: a call's schema becomes the structured output."""
    _refuse_extensions(req, CHAT_NOT_IMPLEMENTED)
    msg = _common(req, label)
    if tools is not None and tools.schema is not None:
        guides = _structured_outputs(req)
        _refuse(not guides, "tool_choice", f"a tool call cannot be combined with {guides[0][0] if guides else ''}")
        msg.sampling.structured_output.json = _json_text(tools.schema, "tools")
    if tools is not None and tools.parser and PARSERS[tools.parser].keeps_special_tokens and req.skip_special_tokens is None:
        msg.skip_special_tokens = False   # the model's call syntax starts with a special token (mistral's [TOOL_CALLS])
    _set_chat(msg, req.messages, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        msg.sampling.max_tokens = max_tokens
    if req.logprobs:
        msg.sampling.logprobs = True
    if req.top_logprobs:   # without logprobs: refused by the shared validation ("needs logprobs")
        msg.sampling.top_logprobs = req.top_logprobs
    return msg


def tokenize_request(req: TokenizeRequest) -> pb.GenerateRequest:
    """A ``/tokenize`` body as the prompt of a ``GenerateRequest``: tokenized by the code that
    tokenizes a generation's, so the ids are the ones the model would be fed. That code adds the
    tokenizer's default special tokens to a text prompt and the generation prompt to a chat: the
    other choices are refused by name."""
    _refuse((req.prompt is None) != (req.messages is None), "prompt", "send either prompt or messages")
    msg = pb.GenerateRequest()
    if req.prompt is not None:
        _refuse(req.add_special_tokens in (None, True), "add_special_tokens",
                "only true is supported for a prompt (the tokenizer's own special tokens, as generation adds them)")
        _refuse(not req.tools, "tools", "go with messages (the chat template shows them), not a prompt")
        msg.text = req.prompt
        return msg
    _refuse(req.add_special_tokens in (None, False), "add_special_tokens",
            "only false is supported for messages (the chat template places the special tokens)")
    _set_chat(msg, req.messages, req)
    return msg


def _set_chat(msg: pb.GenerateRequest, messages: list[ChatMessage], options) -> None:
    """The messages, and vLLM's chat-template options of ``options`` (a chat or tokenize body)."""
    msg.chat.messages.extend(_message(m, i) for i, m in enumerate(messages))
    msg.chat.SetInParent()   # an empty list is the client's mistake: convert names it
    # Sent only where it differs from what unset means (a client filling in defaults sends the same request).
    if options.add_generation_prompt is not None and options.add_generation_prompt == options.continue_final_message:
        msg.chat.add_generation_prompt = options.add_generation_prompt
    msg.chat.continue_final_message = options.continue_final_message
    if options.chat_template_kwargs:
        msg.chat.template_kwargs_json = _json_text(options.chat_template_kwargs, "chat_template_kwargs")
    if options.tools:
        msg.chat.tools_json = _json_text([tool.model_dump(exclude_none=True) for tool in options.tools], "tools")


def _json_text(value, param: str) -> str:
    """``value`` as JSON text for the proto. It parsed, but a value nested near the parser's limit
    can be deeper still where it is written inside other structures (a tool's schema in the
    required array's): that is the client's, a 400, not our 500."""
    try:
        return json.dumps(value)
    except RecursionError:
        raise InvalidRequestError(param, "nested too deeply") from None


def _message(m: ChatMessage, i: int) -> pb.ChatMessage:
    content = m.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            _refuse(part.type == "text" and part.text is not None, f"messages[{i}].content[{j}]",
                    f"only text content parts are supported, got {part.type!r}")
        content = "\n".join(part.text for part in content)   # vLLM's rendering of text parts (one string, a line each)
    out = pb.ChatMessage(role=_ROLE_ALIASES.get(m.role, m.role), content=content or "",
                         tool_call_id=m.tool_call_id or "", name=m.name or "")
    if m.tool_calls:
        out.tool_calls_json = _json_text([call.model_dump(exclude_none=True) for call in m.tool_calls],
                                         f"messages[{i}].tool_calls")
    return out


def completion_requests(req: CompletionRequest, label: str | None) -> list[pb.GenerateRequest]:
    """One ``GenerateRequest`` per prompt of the body (a batch: a list of texts or of token-id
    lists, as OpenAI's and vLLM's completions take it); only the first carries the client's label
    (one live request per label: the router labels the others)."""
    _refuse_extensions(req, COMPLETION_NOT_IMPLEMENTED)
    _refuse(req.suffix is None, "suffix", "suffix is not supported")
    _refuse(req.best_of is None or req.best_of == 1, "best_of", "only 1 is supported")
    _refuse(not (req.echo and req.truncate_prompt_tokens is not None), "truncate_prompt_tokens",
            "cannot be combined with echo (the echoed prompt would not be the one the model saw)")
    prompts = prompts_of(req)
    _refuse(len(prompts) * req.n <= MAX_GENERATIONS, "prompt", f"{len(prompts)} prompts x n = {req.n} make "
            f"{len(prompts) * req.n} generations; at most {MAX_GENERATIONS} in one request")
    template = _common(req, label)
    if req.max_tokens is not None:
        template.sampling.max_tokens = req.max_tokens
    if req.logprobs is not None:   # logprobs N: the sampled token's, and the N most likely
        template.sampling.logprobs = True
        template.sampling.top_logprobs = req.logprobs
        if req.echo:   # the prompt's tokens are listed too, with their logprobs and N most likely
            template.sampling.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    msgs = []
    for index, prompt in enumerate(prompts):
        msg = pb.GenerateRequest()
        msg.CopyFrom(template)
        if index:
            msg.ClearField("request_id")
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.token_ids.ids.extend(prompt)
        msgs.append(msg)
    return msgs


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The body's prompts: one text or token-id list, or a batch of either."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


def echo_texts(req: CompletionRequest, tokenizer, vocab_size: int) -> list[str]:
    """What ``echo`` puts before each prompt's completions: the prompt as sent, token ids decoded
    (tokenizer work: the caller runs it on the tokenizer pool). The ids are checked first, as
    the generation would check them: a tokenizer cannot decode an id past 32 bits (found by a
    probe: a 500 where the same body without echo got its 400)."""
    prompts = prompts_of(req)
    texts = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            texts.append(prompt)
            continue
        try:
            check_token_ids(prompt, vocab_size, "prompt")
        except InvalidRequestError as exc:
            raise in_batch(exc, index) if len(prompts) > 1 else exc from None
        texts.append(tokenizer.decode(list(prompt), skip_special_tokens=False) if tokenizer is not None else "")
    return texts


def in_batch(exc: InvalidRequestError, index: int) -> InvalidRequestError:
    """A batch prompt's error, naming which prompt of the batch it is."""
    return InvalidRequestError(exc.field, f"the batch's prompt {index}: {exc.message}")


def _common(req, label: str | None) -> pb.GenerateRequest:
    _refuse(1 <= req.n <= MAX_CHOICES, "n", f"must be between 1 and {MAX_CHOICES}, got {req.n}")
    _refuse_extensions(req, NOT_IMPLEMENTED)
    _refuse(req.stream_options is None or req.stream, "stream_options", "goes with stream: true only")   # vLLM's rule
    _refuse(not (req.stream_options and req.stream_options.continuous_usage_stats), "stream_options.continuous_usage_stats",
            "is not supported by this server: the usage comes in the last chunk (include_usage)")
    msg = pb.GenerateRequest()
    if label is not None:
        msg.request_id = label
    for name in _SAMPLING:
        if getattr(req, name) is not None:
            setattr(msg.sampling, name, getattr(req, name))
    for name in _UNLESS_OFF:
        if getattr(req, name) is not None and getattr(req, name) != getattr(_OFF, name):
            setattr(msg.sampling, name, getattr(req, name))
    if req.top_k == VLLM_ALL_TOKENS:
        msg.sampling.top_k = 0   # pdserve's "top-k off" (gRPC refuses -1: its contract names 0 alone)
    for name in _TOP:
        if getattr(req, name) is not None:
            setattr(msg, name, getattr(req, name))
    for key, bias in (req.logit_bias or {}).items():
        token = _token_id(key)
        _refuse(token not in msg.sampling.logit_bias, "logit_bias", f"names token id {token} twice")
        msg.sampling.logit_bias[token] = bias
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    msg.sampling.stop.extend(stops)
    msg.sampling.stop_token_ids.extend(req.stop_token_ids or [])
    _refuse(req.allowed_token_ids != [], "allowed_token_ids", "is empty: no token could be generated "
            "(leave it out for no restriction)")   # vLLM's rule; gRPC's empty list is unset
    msg.sampling.allowed_token_ids.extend(req.allowed_token_ids or [])
    msg.sampling.bad_words.extend(req.bad_words or [])
    if req.truncate_prompt_tokens is not None:
        msg.sampling.truncate_prompt_tokens = req.truncate_prompt_tokens
    guides = _structured_outputs(req)
    _refuse(len(guides) <= 1, guides[-1][0] if guides else "", "one structured output per request, got "
            + ", ".join(param for param, _ in guides))
    if guides:
        msg.sampling.structured_output.CopyFrom(guides[0][1])
    if req.prompt_logprobs is not None:
        # vLLM's rule too: the whole body carries them, a stream's chunks have no place for them.
        _refuse(not req.stream, "prompt_logprobs", "is not supported with stream: true")
        msg.sampling.prompt_logprobs = req.prompt_logprobs
    return msg


def _structured_outputs(req) -> list[tuple[str, pb.StructuredOutput]]:
    """Each structured output the body asks for, with the parameter it came in: OpenAI's
    ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` and its older
    ``guided_*`` fields. More than one is the client's mistake (``_common`` refuses it)."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", pb.StructuredOutput(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        _refuse(schema is not None, "response_format.json_schema.schema", "a json_schema response format needs its schema")
        found.append(("response_format", _guide("json", schema)))
    options = req.structured_outputs
    if options is not None:
        for key, value in (options.model_extra or {}).items():
            _refuse(is_one_of(value, (False,)), f"structured_outputs.{key}", "is not supported by this server; leave it out")
        values = dict(zip(_GUIDE_KINDS, (options.json_, options.json_object, options.regex, options.choice, options.grammar)))
        found += [("structured_outputs", _guide(kind, value)) for kind, value in values.items()
                  if value is not None and value is not False]
    for kind in ("json", "regex", "choice", "grammar"):
        if (value := getattr(req, f"guided_{kind}")) is not None:
            found.append((f"guided_{kind}", _guide(kind, value)))
    return found


def _guide(kind: str, value) -> pb.StructuredOutput:
    """One kind's value as the proto carries it: a schema as JSON text, choices as a list."""
    if kind == "json":
        return pb.StructuredOutput(json=value if isinstance(value, str) else _json_text(value, "guided_json"))
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    return pb.StructuredOutput(**{kind: value})


def _token_id(key: str) -> int:
    """A ``logit_bias`` key: OpenAI's are token ids written as JSON strings ("50256")."""
    _refuse(re.fullmatch(r"-?\d{1,19}", key.strip()), "logit_bias", f"keys must be token ids, got {key!r}")
    token = int(key)
    _refuse(-(2**63) <= token < 2**63, "logit_bias", f"token id {key} is out of range")
    return token


# ---------------------------------------------------------------- field paths, back


_CHAT_OPTIONS = {"chat.add_generation_prompt": "add_generation_prompt",
                 "chat.continue_final_message": "continue_final_message",
                 "chat.template_kwargs_json": "chat_template_kwargs"}


def sent_as(req, *, chat: bool, tools: ToolPlan | None = None) -> dict[str, str]:
    """Field paths this body sent under a name of its choice (``param_for``'s rule would guess
    another): chat's ``max_completion_tokens``, and the parameter of its structured output (a
    tool call's: ``tools``, whose schemas it is made of)."""
    names = {}
    if chat and req.max_completion_tokens is not None:
        names["sampling.max_tokens"] = "max_completion_tokens"
    if guides := _structured_outputs(req):
        names["sampling.structured_output"] = guides[0][0]
    if tools is not None and tools.schema is not None:
        names["sampling.structured_output"] = "tools"
    return names


def param_for(field: str, *, chat: bool, sent_as: dict[str, str] | None = None) -> str:
    """The OpenAI parameter a ``GenerateRequest`` field path stands for (``sampling.top_p`` ->
    ``top_p``, ``chat.messages[1].role`` -> ``messages[1].role``, ``text`` -> ``prompt``);
    a name that is already OpenAI's stays as it is. ``sent_as``: ``sent_as``'s, for the body."""
    for path, name in (sent_as or {}).items():
        if field == path or field.startswith(path + "."):
            return name
    if field == "sampling.top_logprobs" and not chat:
        return "logprobs"   # completions' logprobs N is the top-N count
    if field.startswith("sampling."):
        return field.removeprefix("sampling.")
    if field in _CHAT_OPTIONS:
        return _CHAT_OPTIONS[field]
    if field.startswith("chat.tools_json"):
        return "tools" + field.removeprefix("chat.tools_json")
    if field == "chat" or field.startswith("chat."):
        return "messages" + field.removeprefix("chat").removeprefix(".messages").replace(".tool_calls_json", ".tool_calls")
    if field in ("text", "token_ids"):
        return "prompt"
    if field == "prompt":
        return "messages" if chat else "prompt"
    if field == "request_id":
        return "X-Request-Id"
    return field
