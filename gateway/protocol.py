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

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.sampling_params import MAX_LOGPROBS
from gateway import structured, vllm_constraints
from gateway.errors import RequestError
from gateway.front_door import OutputFormat, RequestView, SessionSources, ToolChoice, ToolSpec
from gateway.nullable import drop_defaulted_nulls
from gateway.sampling import INT32_MAX, UINT32_MAX, FieldNames, logit_bias_entries
from gateway.structured import SCHEMA_PARAM
from protos import common_pb2

# The wire's range of `n` (uint32); the limit is the gateway's --max-n (gateway/front_door.py).
_N_WIRE_MAX = (1 << 32) - 1


class _Body(BaseModel):
    # inf and NaN are no sampling value (`"temperature": 1e400` parses as inf and sampled
    # uniformly): a 400 naming the field, as for any other value out of range
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_defaulted_nulls(cls, data)  # `"n": null` is n's default (gateway/nullable.py)


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
    # "function" and function_call: OpenAI's legacy function calling (baton/chat_format.py)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None


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
    # vLLM's: usage on every chunk too (only with include_usage, as vLLM reads it)
    continuous_usage_stats: bool = False


class _Generation(Request):
    """Fields both endpoints share."""

    # absent or null: the served model (vLLM's rule; OpenAI requires it)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # OpenAI's range, as vLLM checks
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)  # vLLM's range (int64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=_N_WIRE_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    # ids past int32 are no token of any model (and the workers' wire is int32); the
    # vocabulary is checked in gateway/sampling.py
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
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
    # vLLM's structured outputs: JSON kinds enforced, others refused (gateway/vllm_constraints.py)
    structured_outputs: Any = None
    # OpenAI's prompt-cache key: a session key after the headers (gateway/sessions.py).
    prompt_cache_key: str | None = None
    # vLLM's: the prompt tokens' logprobs, each with its top k (-1, the whole vocabulary,
    # is refused); computed by the decode worker over the whole prompt, no cache read.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep only the prompt's last k tokens (-1: the context length); front_door.py
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: logprobs name each token "token_id:N" (null: the gateway's flag)
    return_tokens_as_token_ids: bool | None = None

    def check(self) -> None:
        """Checks across fields, made after parsing (RequestError naming the field)."""
        self.check_stream_fields()

    def check_stream_fields(self) -> None:
        """prompt_logprobs is not streamed (vLLM's 400); stream_options need a stream
        (OpenAI's and vLLM's 400: a client asking for usage chunks of a plain response
        would otherwise wait for chunks that never come; `{}`, like vLLM, sets nothing)."""
        opts = self.stream_options
        if opts is not None and not self.stream and (opts.model_fields_set or opts.model_extra):
            raise RequestError("`stream_options` can only be defined when `stream=True`.",
                               "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("`prompt_logprobs` are not available when `stream=True`.",
                               "prompt_logprobs")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The top k of the prompt's logprobs the workers compute (None: none)."""
        return self.prompt_logprobs

    def wire_params(self) -> common_pb2.SamplingParams:
        """The sampling fields as the workers' message (max_tokens unset: the room left;
        the context, vocabulary and stop checks: gateway/sampling.py). RequestError: a
        logit_bias key that is not a token id."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        p = common_pb2.SamplingParams(
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=logit_bias_entries(self.logit_bias), n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p or 1.0, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens, stop=stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)
        if self.requested_max_tokens is not None:
            p.max_tokens = self.requested_max_tokens
        if self.seed is not None:
            p.seed = self.seed % (1 << 64)
        if self.num_logprobs is not None:
            p.logprobs = self.num_logprobs
        if self.num_prompt_logprobs is not None:
            p.prompt_logprobs = self.num_prompt_logprobs
        return p

    def output_format(self) -> OutputFormat | None:
        """response_format or vLLM's structured_outputs as the front door's OutputFormat
        (None: free text); a vLLM constraint Baton does not enforce is a RequestError
        (gateway/vllm_constraints.py)."""
        vllm_constraints.refuse_unsupported(self.model_extra or {})
        fmt = self._response_format()
        vllm = vllm_constraints.structured_outputs_format(self.structured_outputs, fmt)
        return fmt if vllm is None else vllm

    def _response_format(self) -> OutputFormat | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return OutputFormat("json_object")
        if fmt.json_schema is None:
            raise RequestError("response_format json_schema needs a json_schema object",
                               "response_format")
        if fmt.json_schema.schema_ is None:
            raise RequestError("response_format json_schema needs json_schema.schema",
                               "response_format.json_schema")
        return OutputFormat("json_schema", fmt.json_schema.schema_, SCHEMA_PARAM)

    def session_sources(self) -> SessionSources:
        """The body's session keys (after the headers) and its retention hint."""
        return SessionSources(body=(self.prompt_cache_key, self.user),
                              kv_retention=self.kv_retention)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def view(self) -> RequestView:
        """The fields the event loop reads once the request is prepared."""
        return RequestView(self.model, self.n, self.stream, self.include_usage,
                           self.num_logprobs, prompt_logprobs=self.prompt_logprobs is not None,
                           continuous_usage=self.include_usage and bool(
                               self.stream_options.continuous_usage_stats),
                           tokens_as_ids=self.return_tokens_as_token_ids)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # false: only the first tool call the model writes is returned (as vLLM does)
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # vLLM's: the output continues the last assistant message (add_generation_prompt false).
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the answer starts with the last message's content when that message is in the
    # answer's role (a continued assistant message comes back whole); gateway/prepare.py
    echo: bool = False

    def check(self) -> None:
        """top_logprobs above 0 needs logprobs true; `tools` is absent or non-empty; a
        tool_choice other than "none" needs tools; a `content` sent as null is an assistant
        message's only (vLLM's 400s, OpenAI's rules)."""
        self.check_stream_fields()
        for i, m in enumerate(self.messages):
            if m.content is None and "content" in m.model_fields_set and m.role != "assistant":
                raise RequestError(f"Invalid type for 'messages[{i}].content': expected a "
                                   "string or an array of content parts, but got null instead.",
                                   f"messages[{i}].content")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true",
                               "top_logprobs")
        if self.tools == []:
            raise RequestError("`tools` must not be an empty array. Either provide at least "
                               "one tool or omit the field entirely.", "tools")
        if self.tools is None and self.tool_choice not in (None, "none"):
            raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def field_names(self) -> FieldNames:
        """Errors about the output's length name the field the client used."""
        return FieldNames(max_tokens="max_completion_tokens"
                          if self.max_completion_tokens is not None else "max_tokens")

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The offered functions, each with its field name."""
        return tuple(ToolSpec(t.function.name, t.function.description, t.function.parameters,
                              structured.parameters_param(i))
                     for i, t in enumerate(self.tools or ()))

    def tool_choice_spec(self) -> ToolChoice:
        """tool_choice as the front door's ToolChoice (RequestError: a bad shape)."""
        choice, parallel = self.tool_choice, self.parallel_tool_calls is not False
        if choice in (None, "auto", "none", "required"):
            return ToolChoice(choice or "auto", parallel=parallel)
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise RequestError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}', "tool_choice")
        return ToolChoice("named", name, parallel=parallel)


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's default for completions; a null is that default too (it was the room left)
    max_tokens: int = Field(16, ge=0, le=UINT32_MAX)
    # The prompt's text before each choice's (gateway/prepare.py); with max_tokens 0 only it.
    echo: bool = False
    # Fill-in-the-middle text after the completion: not served (a 400, as vLLM answers, rather
    # than a completion that silently ignores it)
    suffix: str | None = None

    def check(self) -> None:
        """max_tokens 0 only with echo (vLLM's rule); no suffix."""
        self.check_stream_fields()
        if self.suffix:
            raise RequestError("suffix is not supported: this server does not complete "
                               "text in the middle (send the prompt alone)", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be at least 1 (0 only with echo)",
                               "max_tokens")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs k: the prompt's logprobs with top k lead the output's (vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        # echo with max_tokens 0: one token is generated and dropped, as vLLM does
        return 1 if self.echo and self.max_tokens == 0 else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
