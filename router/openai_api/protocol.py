"""The request bodies of the OpenAI API as pydantic models: what a client may send.

Unknown fields are ignored (clients send ``user``, ``metadata`` and the like, which change
nothing here), as vLLM does; known fields this server cannot honour are refused by
``requests.py`` with a 400 that names them, never silently dropped. Beside OpenAI's fields,
vLLM's common extras are accepted (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``: the ``extra_body`` of the ``openai`` client) and pdserve's SLO hints
(``ttft_ms``, ``tpot_ms``, ``priority``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # pdserve's SLO hints (as in GenerateRequest)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    priority: int | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
