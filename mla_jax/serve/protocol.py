"""OpenAI API request bodies (pydantic), with vLLM's extensions (top_k, stop_token_ids, ignore_eos, ...).

The models check only types and shapes; value ranges are checked in `mla_jax.serve.serving`, whose messages name
the field and the value. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    temperature: float | None = None  # None: generation_config.json's default (else 1)
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; 0 or -1: off
    n: int = 1
    seed: int | None = None  # None: a random one (choice i uses seed + i)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-n alternatives per token (0: only the sampled token's logprob)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: passed to the template as they are

    role: str
    content: str | list[TextPart | dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to max_model_len (or generation_config.json's max_new_tokens)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
