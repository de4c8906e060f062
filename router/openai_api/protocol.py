"""The request bodies of the OpenAI API as pydantic models: what a client may send.

Unknown fields are ignored (clients send ``user``, ``metadata`` and the like, which change
nothing here), as vLLM does; a field sent as ``null`` is a field left out (OpenAI's schema makes
every optional parameter nullable, and many clients write unset fields as null); known fields
this server cannot honour are refused by ``requests.py`` with a 400 that names them, never
silently dropped: OpenAI's, and vLLM's extensions that would change the output (guided
decoding, a custom chat template, ...), which the request models
keep among their extra fields for ``requests.py`` to look at. Beside OpenAI's fields,
vLLM's common extras are accepted (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``repetition_penalty``, ``min_p``, ``min_tokens``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``,
``structured_outputs`` and its older ``guided_*`` names: the ``extra_body`` of the ``openai``
client), OpenAI's tools (``tool_calls.py`` says which tool choices are served) and pdserve's SLO hints
(``ttft_ms``, ``tpot_ms``, ``priority``).

Every integer and string that becomes a ``GenerateRequest`` field is typed with that field's
width here (``Int32``, ``Int64``, ``Text``: UTF-8, so no lone surrogate, which JSON's ``\\u``
escapes can spell): a value it cannot hold is a 400 naming the parameter, as any wrong type is,
instead of protobuf's ValueError (a 500). Whether a value that fits makes sense (max_tokens
within max_model_len, a token id in the vocabulary) is the shared validation's question.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(f"not valid Unicode: lone surrogate {bad!r} at index {exc.start} (a \\u escape of "
                         "a surrogate must be one of a high-low pair)") from None
    return text


Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]    # the proto's int32 fields
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]    # int64: seeds, token ids
Text = Annotated[str, AfterValidator(_utf8)]                 # proto strings are UTF-8


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """``"n": null`` is ``n`` left out: its default applies (a required field stays required)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's usage in every chunk: refused (requests.py), never dropped


class ContentPart(_Body):
    type: str
    text: Text | None = None


class FunctionCall(_Body):
    name: Annotated[Text, Field(min_length=1)]
    arguments: Text | dict[str, Any] | None = None   # OpenAI's JSON text; an object is taken too


class ToolCall(_Body):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Text
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's calls (its content may then be left out)
    tool_call_id: Text | None = None           # a tool message: the call it answers
    name: Text | None = None


class FunctionDefinition(_Body):
    name: Annotated[Text, Field(min_length=1)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None   # the client's label: a call always follows the schema here


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: the schema constrains the output; name,
    description and strict are the client's labels (the output always follows the schema)."""

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: one of a JSON schema, any JSON object, a regex, a list of
    choices or a grammar (Lark or GBNF). Its other options are refused by ``requests.py``."""

    model_config = ConfigDict(extra="allow")

    json_: dict[str, Any] | Text | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


class _Sampling(_Body):
    model_config = ConfigDict(extra="allow")   # kept in ``model_extra``: requests.py refuses vLLM's unimplemented ones

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: Annotated[Int32, Field(strict=True)] | None = None   # a JSON true is no count
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[Text] | None = None
    truncate_prompt_tokens: Int32 | None = None
    prompt_logprobs: Int32 | None = None   # the prompt's logprobs and top N (not with stream)
    # Structured output, at most one of: OpenAI's, vLLM's, and vLLM's older names of the same
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | bool | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # pdserve's SLO hints (as in GenerateRequest)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    priority: Int32 | None = None


class _ChatTemplateOptions(_Body):
    """vLLM's chat-template options: open the assistant's turn (default) or continue the last
    message, and more variables for the template (e.g. ``{"enable_thinking": false}``)."""

    add_generation_prompt: bool | None = None   # None: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None   # shown to the model by the template (vLLM's /tokenize takes them too)


class ChatCompletionRequest(_Sampling, _ChatTemplateOptions):
    model_config = ConfigDict(extra="allow")   # _Sampling's (the mixin's base would ignore them)

    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # tool_calls.py
    parallel_tool_calls: bool | None = None   # false: "required" makes exactly one call


class CompletionRequest(_Sampling):
    prompt: Text | list[Int64] | list[Text] | list[list[Int64]]
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_ChatTemplateOptions):
    """vLLM's ``/tokenize``: a completion's ``prompt`` or a chat's ``messages`` (then through the
    chat template), tokenized as a generation request would be."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None    # vLLM's default: True for a prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[Int64]


class InputContent(_Body):
    """A part of a Responses API message: its text (``input_text``; ``output_text`` in an
    assistant turn sent back). Other kinds (images, files) are refused by ``responses_api.py``."""

    type: Text
    text: Text | None = None


class InputMessage(_Body):
    """An item of the Responses API's ``input`` list: a message (its ``type`` left out or
    ``"message"``; other item kinds, tool calls and their outputs, are refused)."""

    type: Text = "message"
    role: Text | None = None
    content: Text | list[InputContent] | None = None


class TextFormat(_Body):
    """The Responses API's ``text.format``: free text, any JSON object, or JSON following a schema
    (its name, description and strict are the client's labels, as in ``JsonSchemaFormat``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Sampling):
    """OpenAI's Responses API body (``POST /v1/responses``), stateless: generation runs through
    the chat path (``responses_api.py``). The chat API's names for the same things (``messages``,
    ``max_tokens``, ``response_format``, ``n``) are not this API's: refused by name."""

    input: Text | list[InputMessage]
    instructions: Text | None = None
    max_output_tokens: Int32 | None = None
    text: TextOptions | None = None
    store: bool | None = None                 # nothing is stored here: answered as false
    metadata: dict[str, Text] | None = None   # echoed back
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: Text | None = None
    conversation: Any = None
    reasoning: Any = None
    include: list[Any] | None = None
    background: bool | None = None
    truncation: Text | None = None
    top_logprobs: Int32 | None = None
    user: Text | None = None
