"""OpenAI's Responses API request (`POST /v1/responses`, stateless) → the front door's
FrontRequest, in the preparation pool (gateway/prep_pool.py).

    instructions                       → a system message first
    input: a string                    → one user message
    input: items
      message {role, content}          → a chat message (content: a string or input_text /
                                         output_text parts; an image or file → 400); the
                                         role developer is rendered as system
      function_call {call_id, name, arguments}
                                       → a tool call of the assistant turn before it (a new
                                         assistant turn when there is none)
      function_call_output {call_id, output}   → a `tool` message
      reasoning                        → dropped (never produced here)
    tools[] {type "function", name, description, parameters}   (other types → 400)
    tool_choice auto | none | required | {type "function", name}
    max_output_tokens, temperature, top_p      → SamplingParams
    text.format text | json_object | json_schema {schema}      → the structured output
    prompt_cache_key, then user        → session keys after the headers (gateway/sessions.py)
    store: true, previous_response_id, conversation
                                       → 400: the server keeps nothing; send the whole input
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.errors import GatewayError, RequestError
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
)
from gateway.ignored_fields import ignored_fields
from gateway.nullable import drop_defaulted_nulls
from gateway.prep_pool import PrepContext
from gateway.prepare import parse_body
from gateway.sampling import UINT32_MAX, FieldNames
from protos import common_pb2

_NAMES = FieldNames(max_tokens="max_output_tokens", prompt="input")
_TEXT_PARTS = ("input_text", "output_text", "text")
STATELESS = ("this server is stateless: it stores no response, so send the whole "
             "conversation in `input` every turn (store: false, no previous_response_id)")


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_defaulted_nulls(cls, data)  # a null is the default (gateway/nullable.py)


class Item(_Part):
    """One input item; which fields count depends on `type` (checked in translation)."""

    type: str = "message"
    role: str | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None


class FunctionTool(_Part):
    type: str
    name: str | None = Field(None, min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Part):
    format: TextFormat | None = None


class ResponsesRequest(_Part):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class Echo:
    """Request fields a Response object repeats, as OpenAI's does (clients read them back)."""

    tool_choice: Any
    temperature: float
    top_p: float
    max_output_tokens: int | None
    text_format: dict[str, Any]
    tools: tuple[dict[str, Any], ...] = ()
    instructions: str | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool = True


def prepare_responses(ctx: PrepContext, raw: bytes, routing: Routing
                      ) -> tuple[Prepared, Echo]:
    """A /v1/responses body, prepared, and the fields its Response repeats."""
    body = parse_body(ResponsesRequest, raw)
    if body.store:
        raise GatewayError(400, STATELESS, param="store", code="invalid_request")
    for name in ("previous_response_id", "conversation"):
        if getattr(body, name):
            raise GatewayError(400, STATELESS, param=name, code="invalid_request")
    params = common_pb2.SamplingParams(
        n=1, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0)
    if body.max_output_tokens is not None:
        params.max_tokens = body.max_output_tokens
    fmt = body.text.format if body.text and body.text.format else None
    front = FrontRequest(
        body.model, ChatPrompt(field_errors(chat_messages, body)), params,
        RequestView(body.model, 1, body.stream, True, None),
        tools=field_errors(_tools, body.tools or []),
        tool_choice=field_errors(_tool_choice, body.tool_choice,
                                 body.parallel_tool_calls is not False),
        output_format=field_errors(_output_format, fmt),
        sessions=SessionSources(body=(body.prompt_cache_key, body.user)),
        ignored=tuple(ignored_fields(body)), names=_NAMES)
    echo = Echo(body.tool_choice or "auto", params.temperature, params.top_p,
                body.max_output_tokens,
                fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
                body.instructions, body.metadata,
                body.parallel_tool_calls is not False)
    return prepare(ctx, front, routing), echo


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """The conversation as OpenAI chat messages (see the module docstring)."""
    out: list[dict] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        if item.type == "message":
            out.append(_message(item, param))
        elif item.type == "function_call":
            _call(out, item, param)
        elif item.type == "function_call_output":
            if not item.call_id:
                raise RequestError("a function_call_output needs its call_id", param)
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, f"{param}.output")})
        elif item.type == "item_reference":
            raise RequestError(STATELESS, param)
        elif item.type != "reasoning":
            raise RequestError(f"input items of type {item.type!r} are not supported", param)
    if not out:
        raise RequestError("input must not be empty", "input")
    return out


def _message(item: Item, param: str) -> dict:
    if item.role not in ("user", "assistant", "system", "developer"):
        raise RequestError('a message\'s role must be "user", "assistant", "system" or '
                           '"developer"', f"{param}.role")
    role = "system" if item.role == "developer" else item.role
    return {"role": role, "content": _text(item.content, f"{param}.content")}


def _call(out: list[dict], item: Item, param: str) -> None:
    """Add a function_call to the assistant turn it belongs to."""
    if not (item.call_id and item.name):
        raise RequestError("a function_call needs call_id and name", param)
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments or "{}"}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: str | list[_Part] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        extra = part.model_extra or {}
        kind, text = extra.get("type"), extra.get("text")
        if kind not in _TEXT_PARTS or not isinstance(text, str):
            raise RequestError(f"content parts of type {kind!r} are not supported (text "
                               "only)", f"{param}[{j}]")
        texts.append(text)
    return "\n".join(texts)  # as chat's parts (baton/chat_format.py message_text) and vLLM


def _tools(tools: list[FunctionTool]) -> tuple[ToolSpec, ...]:
    for i, t in enumerate(tools):
        if t.type != "function" or not t.name:
            raise RequestError(f"tools of type {t.type!r} are not supported (function tools "
                               "with a name only)", f"tools[{i}]")
    return tuple(ToolSpec(t.name, t.description, t.parameters, f"tools[{i}].parameters")
                 for i, t in enumerate(tools))


def _tool_choice(choice: str | dict | None, parallel: bool) -> ToolChoice:
    if choice is None or isinstance(choice, str):
        return ToolChoice(choice or "auto", parallel=parallel)
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError('tool_choice must be "auto", "none", "required" or '
                           '{"type": "function", "name": ...}', "tool_choice")
    return ToolChoice("named", choice["name"], parallel=parallel)


def _output_format(fmt: TextFormat | None) -> OutputFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputFormat("json_object", param="text.format")
    if fmt.schema_ is None:
        raise RequestError("text.format json_schema needs a schema", "text.format.schema")
    return OutputFormat("json_schema", fmt.schema_, "text.format.schema")

