"""A chat prompt, checked, and rendered by the model's chat template into token ids.

Life cycle: ``chat_from_proto`` checks a ``ChatMessages`` (roles, contents, template options,
tools and earlier tool calls) into a ``ChatPrompt`` before anything is queued, naming the field
at fault; ``encode_chat`` (on the tokenizer pool: templates are slow) renders it with
``apply_chat_template``, as transformers would for the same messages. A template that refuses
the conversation (roles that do not alternate, a final message it cannot continue) is the
client's input, not our bug: INVALID_ARGUMENT naming ``chat``.

Tool use, as vLLM passes it to Hugging Face templates: ``tools_json`` is the template's ``tools``
(a list of OpenAI function definitions); an assistant message may carry ``tool_calls_json`` (its
content may then be empty), each call's ``arguments`` given to the template as an object (a JSON
text of one is parsed: tool-use templates write ``arguments | tojson``); a tool message carries
the ``tool_call_id`` it answers. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError, require
from protos import pdserve_pb2 as pb

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# apply_chat_template's own arguments and the template's standard variables: not the client's to set.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "bos_token", "eos_token",
})


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat, checked: its messages and how the chat template renders them."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True     # open the assistant's turn after the messages
    continue_final_message: bool = False   # or leave the last message open, to be continued
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # more variables for the template
    tools: list[dict[str, Any]] | None = None   # the template's ``tools``: OpenAI function definitions


def chat_from_proto(chat: pb.ChatMessages) -> ChatPrompt:
    require(len(chat.messages) > 0, "chat.messages", "no messages")
    messages = [_message(m, f"chat.messages[{i}]") for i, m in enumerate(chat.messages)]
    continue_final = chat.continue_final_message
    # Unset: open the assistant's turn, unless the last message is to be continued (vLLM makes
    # its clients say false; either way, both true is refused).
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not continue_final
    require(not (add and continue_final), "chat.continue_final_message",
            "cannot be combined with add_generation_prompt: continue the last message or open a new turn")
    return ChatPrompt(messages, add, continue_final, _template_kwargs(chat.template_kwargs_json),
                      _tools(chat.tools_json) if chat.tools_json else None)


def _message(m: pb.ChatMessage, path: str) -> dict[str, Any]:
    require(m.role, f"{path}.role", "empty role")
    require(m.role in CHAT_ROLES, f"{path}.role", f"unknown role {m.role!r}, expected one of {sorted(CHAT_ROLES)}")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        require(m.role == "assistant", f"{path}.tool_calls_json", "only an assistant message carries tool calls")
        out["tool_calls"] = _tool_calls(m.tool_calls_json, f"{path}.tool_calls_json")
    else:
        require(m.content, f"{path}.content", "missing content")
    if m.tool_call_id:
        require(m.role == "tool", f"{path}.tool_call_id", "only a tool message answers a tool call")
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _json(text: str, path: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(path, f"not {what}: {exc}") from None


def _tool_calls(text: str, path: str) -> list[dict[str, Any]]:
    calls = _json(text, path, "a JSON array of tool calls")
    require(isinstance(calls, list) and calls, path, "must be a non-empty JSON array of tool calls")
    for i, call in enumerate(calls):
        at = f"{path}[{i}]"
        require(isinstance(call, dict) and isinstance(call.get("function"), dict), at,
                'each tool call is {"id", "type": "function", "function": {"name", "arguments"}}')
        function = call["function"]
        require(isinstance(function.get("name"), str) and function["name"], f"{at}.function.name", "a function name")
        function["arguments"] = _arguments(function.get("arguments"), f"{at}.function.arguments")
    return calls


def _arguments(arguments: Any, path: str) -> dict[str, Any]:
    """A call's arguments as the template sees them: an object (OpenAI sends its JSON text)."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        arguments = _json(arguments, path, "a JSON object")
    require(isinstance(arguments, dict), path, "must be a JSON object (or its JSON text)")
    return arguments


def _tools(text: str) -> list[dict[str, Any]]:
    path = "chat.tools_json"
    tools = _json(text, path, "a JSON array of tools")
    require(isinstance(tools, list), path, "must be a JSON array of tools")
    for i, tool in enumerate(tools):
        require(isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict),
                f"{path}[{i}]", 'each tool is {"type": "function", "function": {"name", "description", "parameters"}}')
        name = tool["function"].get("name")
        require(isinstance(name, str) and name, f"{path}[{i}].function.name", "a function name")
    return tools


def _template_kwargs(text: str) -> dict[str, Any]:
    if not text:
        return {}
    kwargs = _json(text, "chat.template_kwargs_json", "a JSON object")
    require(isinstance(kwargs, dict), "chat.template_kwargs_json", "must be a JSON object of template variables")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    require(not reserved, "chat.template_kwargs_json", f"may not set {', '.join(reserved)}")
    return kwargs


def encode_chat(chat: ChatPrompt, tokenizer: Any) -> list[int]:
    """The chat's token ids through ``tokenizer``'s chat template (a Hugging Face tokenizer)."""
    try:
        out = tokenizer.apply_chat_template(chat.messages, tools=chat.tools,
                                            add_generation_prompt=chat.add_generation_prompt,
                                            continue_final_message=chat.continue_final_message, tokenize=True,
                                            **chat.template_kwargs)
    except Exception as e:
        # No chat template (ValueError), a final message the template does not end with
        # (continue_final_message: ValueError), the template refusing this conversation, e.g.
        # roles that do not alternate (jinja2's TemplateError), or the client's template
        # variables, tools or tool calls of a type it cannot use (TypeError) or nested deeper than it
        # can write them (RecursionError, ``tojson``): the client's input, not our bug.
        client_typed = chat.template_kwargs or chat.tools or any("tool_calls" in m for m in chat.messages)
        if isinstance(e, ValueError) or type(e).__module__.startswith("jinja2") \
                or (client_typed and isinstance(e, (TypeError, RecursionError))):
            raise InvalidRequestError("chat", str(e)) from e
        raise
    # transformers >= 5 returns a BatchEncoding (return_dict defaults to True); older, a list.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)
