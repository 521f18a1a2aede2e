"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`) → the
front door's FrontRequest, in the preparation pool (gateway/prep_pool.py).

    system (string or text blocks)     → a system message, Claude Code's per-request
                                         `x-anthropic-billing-header: ...` line removed (only
                                         that line: it changes every request, and would make
                                         every turn a full prefill)
    messages[].content: string or blocks
      user      text                   → the user message's text (blocks joined by "\\n\\n")
                tool_result            → a `tool` message (tool_call_id = tool_use_id)
                image, document, ...   → 400 naming messages[i].content[j]
      assistant text, tool_use         → content and tool_calls (arguments = input as JSON);
                                         a final assistant text turn is a prefill: the
                                         answer continues it (continue_final_message)
                thinking blocks        → dropped (never produced here; sent back by clients)
    tools[] {name, description, input_schema}   → functions (400 for server tools: tools[i].type)
    tool_choice auto | any | tool{name} | none  → auto | required | named | none
    max_tokens, stop_sequences, temperature, top_p, top_k   → SamplingParams (the last three
                                         are gone from the newest clients; sent, they apply)
    output_config.format {type json_schema, schema}          → the structured output
    metadata.user_id                   → a session key after the headers (gateway/sessions.py)
Fields nothing reads (thinking, service_tier, ...) are named in X-Baton-Ignored-Fields.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.errors import RequestError
from gateway.front_door import (
    ChatPrompt,
    FrontRequest,
    OutputFormat,
    Prepared,
    RequestView,
    Routing,
    SessionSources,
    ToolChoice,
    ToolSpec,
    field_errors,
    prepare,
    prompt_token_count,
)
from gateway.ignored_fields import ignored_fields
from gateway.nullable import drop_defaulted_nulls
from gateway.prep_pool import PrepContext
from gateway.prepare import parse_body
from gateway.sampling import INT32_MAX, UINT32_MAX, FieldNames
from protos import common_pb2

BILLING_LINE = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|\Z)",
                          re.IGNORECASE | re.MULTILINE)
JOIN = "\n\n"
_NAMES = FieldNames(stop="stop_sequences", cap_past_context=True)  # Claude Code: 32,000
_DROPPED = ("thinking", "redacted_thinking")


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_defaulted_nulls(cls, data)  # a null is the default (gateway/nullable.py)


class Block(_Part):
    """One content block; which fields count depends on `type` (checked in translation)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(_Part):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Part):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # absent or "custom": a client tool; anything else a server tool


class ToolChoiceParam(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Part):
    user_id: str | None = None


class JsonFormat(_Part):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Part):
    format: JsonFormat | None = None


class CountTokensRequest(_Part):
    """The body of /v1/messages/count_tokens (also the prompt half of /v1/messages)."""

    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


def prepare_messages(ctx: PrepContext, raw: bytes, routing: Routing) -> Prepared:
    """A /v1/messages body, prepared (GatewayError naming the field)."""
    body = parse_body(MessagesRequest, raw)
    params = common_pb2.SamplingParams(
        n=1, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0, top_k=body.top_k or 0, max_tokens=body.max_tokens,
        stop=body.stop_sequences or [])
    user = body.metadata.user_id if body.metadata else None
    front = _front(body, params, RequestView(body.model, 1, body.stream, True, None),
                   SessionSources(body=(user,)), tuple(ignored_fields(body)))
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        front = replace(front, output_format=OutputFormat(
            "json_schema", fmt.schema_, "output_config.format.schema"))
    return prepare(ctx, front, routing)


def count_tokens_job(ctx: PrepContext, raw: bytes, routing: Routing) -> int:
    """A /v1/messages/count_tokens body → the input tokens a /v1/messages request with it
    would have (system, tools and the generation prompt included)."""
    body = parse_body(CountTokensRequest, raw)
    front = _front(body, common_pb2.SamplingParams(),
                   RequestView(body.model, 1, False, False, None), SessionSources(), ())
    return prompt_token_count(ctx, front)


def _front(body: CountTokensRequest, params, view: RequestView, sessions: SessionSources,
           ignored: tuple[str, ...]) -> FrontRequest:
    messages = field_errors(chat_messages, body)
    tools = field_errors(_tools, body.tools or [])
    last = messages[-1]
    # A final assistant turn is a prefill: the answer continues its text (Anthropic's rule);
    # an empty one asks for nothing.
    prefill = last["role"] == "assistant" and not last.get("tool_calls")
    if prefill and not (last["content"] or "").strip():
        messages, prefill = messages[:-1], False
    prompt = ChatPrompt(messages, add_generation_prompt=not prefill,
                        continue_final_message=prefill)
    return FrontRequest(body.model, prompt, params, view, tools=tools,
                        tool_choice=field_errors(_tool_choice, body.tool_choice),
                        sessions=sessions, ignored=ignored, names=_NAMES)


def strip_billing_header(text: str) -> str:
    """`text` without Claude Code's `x-anthropic-billing-header: ...` line(s)."""
    return BILLING_LINE.sub("", text) if "billing-header" in text.lower() else text


def system_text(system: str | list[Block] | None) -> str:
    """The system prompt as one string, billing line removed (RequestError naming a block
    that is not text)."""
    if system is None:
        return ""
    blocks = [Block(type="text", text=system)] if isinstance(system, str) else system
    parts = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise RequestError(f"system blocks must be text, got {block.type!r}", f"system[{j}]")
        text = strip_billing_header(block.text)
        if text.strip():
            parts.append(text)
    return JOIN.join(parts)


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """The conversation as OpenAI chat messages (see the module docstring). RequestError:
    no messages; a message with empty content ("" or [], or a text block "") other than a
    final assistant one (Anthropic's 400s: it was sent to the model as an empty turn)."""
    system = system_text(body.system)
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    if not body.messages:  # a system prompt alone was served; Anthropic answers 400
        raise RequestError("messages: at least one message is required", "messages")
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        if not m.content and not (i == last and m.role == "assistant"):
            raise RequestError(f"messages.{i}: all messages must have non-empty content except "
                               "for the optional final assistant message",
                               f"messages[{i}].content")
        if not isinstance(m.content, str):
            for j, block in enumerate(m.content):
                if block.type == "text" and block.text == "":
                    raise RequestError("messages: text content blocks must be non-empty",
                                       f"messages[{i}].content[{j}].text")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user(m.content, f"messages[{i}].content")
        else:
            out.append(_assistant(m.content, f"messages[{i}].content"))
    if not out:
        raise RequestError("messages must be a non-empty list", "messages")
    return out


def _user(blocks: list[Block], param: str) -> list[dict]:
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_result" and block.tool_use_id:
            if texts:
                out.append({"role": "user", "content": JOIN.join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block.content, f"{param}[{j}].content")})
        else:
            raise RequestError(_unsupported(block.type, "user"), f"{param}[{j}]")
    if texts or not out:
        out.append({"role": "user", "content": JOIN.join(texts)})
    return out


def _assistant(blocks: list[Block], param: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and block.id and block.name:
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name,
                "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
        elif block.type not in _DROPPED:
            raise RequestError(_unsupported(block.type, "assistant"), f"{param}[{j}]")
    out: dict = {"role": "assistant", "content": JOIN.join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    return out


def _result_text(content: str | list[Block] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise RequestError(_unsupported(block.type, "tool_result"), f"{param}[{j}]")
        texts.append(block.text)
    return JOIN.join(texts)


def _unsupported(kind: str, where: str) -> str:
    if kind in ("image", "document"):
        return f"{kind} content is not supported (the served model reads text only)"
    return f"content block of type {kind!r} is not supported in a {where} message " \
           "(or misses its required fields)"


def _tools(tools: list[Tool]) -> tuple[ToolSpec, ...]:
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise RequestError(f"tool type {t.type!r} is not supported (client tools with "
                               "input_schema only)", f"tools[{i}].type")
        if t.input_schema is None:  # required by Anthropic's API (it was read as no inputs)
            raise RequestError(f"tools.{i}.custom.input_schema: Field required",
                               f"tools[{i}].input_schema")
    return tuple(ToolSpec(t.name, t.description, t.input_schema, f"tools[{i}].input_schema")
                 for i, t in enumerate(tools))


def _tool_choice(choice: ToolChoiceParam | None) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto")
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("auto", "none"):
        return ToolChoice(choice.type, parallel=parallel)
    if choice.type == "any":
        return ToolChoice("required", parallel=parallel)
    if not choice.name:
        raise RequestError('tool_choice {"type": "tool"} needs a name', "tool_choice.name")
    return ToolChoice("named", choice.name, parallel=parallel)
