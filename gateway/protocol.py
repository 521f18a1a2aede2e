"""OpenAI request bodies (pydantic) and their mapping onto the workers' SamplingParams.

Unknown top-level fields are accepted and named in a response header
(gateway/ignored_fields.py); known fields are type- and range-checked, so a bad value is a 400
naming the field. vLLM's extensions `top_k`, `min_p`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens` are accepted too, as
are the penalties (`presence_penalty`, `frequency_penalty`, vLLM's `repetition_penalty`) and
`logit_bias`, which the workers apply. `response_format` and a forced `tool_choice` become a
StructuredOutput the workers decode under (gateway/structured.py); its schemas and the tools
are bounded by gateway/limits.py.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.sampling_params import MAX_LOGPROBS
from gateway import structured
from gateway.errors import RequestError
from gateway.limits import RequestLimits
from protos import common_pb2

MAX_N = 128
MAX_STOP = 64


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Body):
    name: str
    # JSON text, as OpenAI clients send it (a mapping is accepted too).
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: the JSON key is mapped onto schema_.
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # always enforced: the output follows the schema or is cut off


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Request(_Body):
    """A top-level body: unknown fields are kept, to be named (gateway/ignored_fields.py)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(Request):
    include_usage: bool = False


class _Generation(Request):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # Session KV retention: seconds, or {"ttl_s": seconds}; checked in gateway/session_hints.py.
    kv_retention: Any = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    # OpenAI's shape: token ids as JSON object keys (strings); checked in logit_bias_ids.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    def structured_output(self, checker: structured.SchemaChecker
                          ) -> common_pb2.StructuredOutput | None:
        """The grammar the output must follow, None for free text. RequestError: a bad
        schema (naming its field)."""
        fmt = self.response_format
        if fmt is None:
            return None
        if fmt.type == "json_schema" and fmt.json_schema is None:
            raise RequestError("response_format json_schema needs a json_schema object",
                               "response_format")
        return structured.from_response_format(
            fmt.type, fmt.json_schema.schema_ if fmt.json_schema else None, checker)

    @property
    def structured_param(self) -> str | None:
        """The field the structured output comes from (None: there is none)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        return structured.SCHEMA_PARAM if fmt.type == "json_schema" else "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def unenforced_fields(self) -> list[str]:
        """Known fields whose value asks for more than the gateway does (named like ignored
        fields, gateway/ignored_fields.py)."""
        return []


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def structured_param(self) -> str | None:
        """A forced call's schema comes from the tools, else response_format's."""
        if self.tool_choice not in (None, "none", "auto"):
            return "tools"
        return super().structured_param

    def structured_output(self, checker: structured.SchemaChecker
                          ) -> common_pb2.StructuredOutput | None:
        """A forced tool call (tool_choice "required" or named) before response_format."""
        tools = [(t.function.name, t.function.parameters) for t in self.tools or ()]
        forced = structured.from_tool_choice(tools, self.tool_choice, checker)
        return forced if forced is not None else super().structured_output(checker)

    def check_tools(self, limits: RequestLimits) -> None:
        """RequestError naming the field: more tools than `limits` allow, or a tool whose
        parameters are not an object schema or too large (gateway/structured.py)."""
        limits.check_tools(len(self.tools or ()))
        for i, tool in enumerate(self.tools or ()):
            param = structured.parameters_param(i)
            limits.schema_text(structured.object_schema(tool.function.parameters, param), param)


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int) -> list[tuple[int, float]]:
    """OpenAI's logit_bias {"token id": value} → (id, value) pairs, ids in order; RequestError
    for a key that is not a token id of the vocabulary or a value outside [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise RequestError(f"logit_bias token id {token_id} is outside the vocabulary "
                               f"[0, {vocab_size})", "logit_bias")
        if token_id in out:
            raise RequestError(f"logit_bias lists token id {token_id} twice", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {value}",
                               "logit_bias")
        out[token_id] = value
    return sorted(out.items())


def to_sampling_params(body: _Generation, num_logprobs: int | None, prompt_len: int,
                       max_model_len: int, vocab_size: int,
                       checker: structured.SchemaChecker) -> common_pb2.SamplingParams:
    """Request → proto SamplingParams; RequestError when the prompt and max_tokens do not fit."""
    room = max_model_len - prompt_len
    requested = body.requested_max_tokens
    if room < 1 or (requested is not None and requested > room):
        want = f"{prompt_len} prompt tokens" + (f" + {requested} max_tokens" if requested else "")
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens; "
                           f"the request needs {want}.", "max_tokens" if room >= 1 else "messages")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise RequestError(f"stop must hold at most {MAX_STOP} non-empty strings", "stop")
    max_tokens = requested if requested is not None else room
    if body.min_tokens > max_tokens:
        raise RequestError("min_tokens must be <= max_tokens", "min_tokens")
    params = common_pb2.SamplingParams(
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=[common_pb2.TokenBias(token_id=t, bias=b)
                    for t, b in logit_bias_ids(body.logit_bias, vocab_size)],
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0, top_k=body.top_k or 0, min_p=body.min_p or 0.0,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens, stop=stop, stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens)
    so = body.structured_output(checker)
    if so is not None:
        params.structured_output.CopyFrom(so)
    if body.seed is not None:
        params.seed = body.seed % (1 << 64)
    if num_logprobs is not None:
        params.logprobs = num_logprobs
    if any(t < 0 for t in params.stop_token_ids):
        raise RequestError("stop_token_ids must be >= 0", "stop_token_ids")
    return params
