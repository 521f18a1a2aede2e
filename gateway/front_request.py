"""What every API front hands the front door (gateway/front_door.py): one `FrontRequest`,
its wire shape translated (tools, tool choice, output format, chat or completion prompts,
session sources, the fields the event loop reads back: `RequestView`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.sampling import FieldNames
from protos import common_pb2


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call. parameters: its JSON Schema (None: any object);
    param: the front's name for that schema (`tools[3].function.parameters`,
    `tools[3].input_schema`, ...)."""

    name: str
    description: str | None
    parameters: Any
    param: str

    def openai(self) -> dict:
        """The OpenAI `tools[]` entry the chat template renders."""
        function: dict = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """mode: "auto", "none", "required" (any one tool) or "named" (`name`); param: the
    front's field; parallel False: at most one call is returned (OpenAI's
    `parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use: true`)."""

    mode: str = "auto"
    name: str | None = None
    param: str = "tool_choice"
    parallel: bool = True


@dataclass(frozen=True)
class OutputFormat:
    """A response format: kind "text", "json_object" or "json_schema" (`schema`); param:
    the front's name for the schema (`response_format.json_schema.schema`,
    `text.format.schema`)."""

    kind: str
    schema: Any = None
    param: str = "response_format"


@dataclass(frozen=True)
class ChatPrompt:
    """OpenAI-shaped chat messages (gateway/prompts.py normalizes them for the template);
    continue_final_message: the output continues the last (assistant) message's text;
    template_kwargs: vLLM's chat_template_kwargs, more variables for the template."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict | None = None


@dataclass(frozen=True)
class SessionSources:
    """explicit: a session the request names ahead of every header (the gRPC field);
    body: the body's keys read after the headers, in order (prompt_cache_key, user);
    kv_retention: the body's TTL hint; end: the request says it is the last turn."""

    explicit: str = ""
    body: tuple[str | None, ...] = ()
    kv_retention: Any = None
    end: bool = False


@dataclass(frozen=True)
class RequestView:
    """The body fields the event loop reads once the request is prepared; echo: each prompt's
    text, put before its choices' (completions' `echo`; echo_only: nothing else);
    prompt_logprobs: answer vLLM's `prompt_logprobs` field; continuous_usage: usage on every
    chunk of a stream (vLLM's stream_options.continuous_usage_stats, with include_usage);
    role: the answer's (OutputSpec.role); tokens_as_ids: logprobs name tokens `token_id:N`
    (vLLM's return_tokens_as_token_ids; None: the gateway's --return-tokens-as-token-ids)."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    num_logprobs: int | None
    echo: tuple[str, ...] | None = None
    echo_only: bool = False
    prompt_logprobs: bool = False
    continuous_usage: bool = False
    role: str = "assistant"
    tokens_as_ids: bool | None = None


@dataclass(frozen=True)
class FrontRequest:
    """One request of any front, its wire shape translated. prompt: a chat, or completion
    prompts (text or token ids). params: every sampling field the wire set (max_tokens unset:
    the room left in the context). structured_output: a grammar the client sent itself
    (gRPC), checked here. truncate_prompt_tokens: vLLM's, keep each prompt's last k tokens
    (-1: the context length; front_door.truncated)."""

    model: str | None
    prompt: ChatPrompt | tuple[str | list[int], ...]
    params: common_pb2.SamplingParams
    view: RequestView
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    output_format: OutputFormat | None = None
    structured_output: common_pb2.StructuredOutput | None = None
    sessions: SessionSources = SessionSources()
    ignored: tuple[str, ...] = ()
    names: FieldNames = field(default_factory=FieldNames)
    truncate_prompt_tokens: int | None = None
