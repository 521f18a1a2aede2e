"""One front door: every API front turns its request into one `FrontRequest`, and `prepare`
turns that into checked, tokenized prompts. Runs in the preparation pool (gateway/prep_pool.py).

    /v1/chat/completions, /v1/completions  gateway/prepare.py            ┐ wire shape →
    /v1/messages (Anthropic)               gateway/anthropic_protocol.py │ FrontRequest
    /v1/responses (OpenAI Responses)       gateway/responses_protocol.py │ (translation
    gRPC Generate                          gateway/grpc_request.py       ┘  only)
                  │
                  ▼  prepare(ctx, request, routing) → Prepared
      1. model check (404)
      2. session and hints: headers in one order, then the body's keys (gateway/sessions.py,
         gateway/session_hints.py)
      3. limits: n (--max-n), the tools' count, each tool's parameters an object schema
         within the size and depth limits (baton/request_limits.py), each named by its front's field
      4. the tool-call parser when tools are offered (--tool-call-parser); a forced
         tool_choice is a grammar in that parser's own format (gateway/structured.py)
      5. template + tokenize each prompt (gateway/prompts.py; per-session incremental:
         gateway/session_tokens.py)
      6. SamplingParams finished per prompt (gateway/sampling.py): the context check, max_tokens
         from the room left, the stop, logit_bias and min_tokens checks, the structured
         output (a forced call, else the response format, else the gRPC client's own)
      7. each prompt's block hashes for the router
Every fault is a GatewayError carrying the front's own field name, so it crosses the pipe.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import GatewayError, RequestError, require_model
from gateway.front_request import (  # noqa: F401 - the fronts import them from here too
    ChatPrompt,
    FrontRequest,
    OutputFormat,
    RequestView,
    SessionSources,
    ToolChoice,
    ToolSpec,
)
from gateway.prep_pool import PrepContext
from gateway.prompts import PromptError
from gateway.sampling import finished_params
from gateway.session_hints import SessionHints, parse_session_hints
from gateway.sessions import SessionKeys, session_keys
from gateway.structured import (
    SchemaChecker,
    check_proto,
    from_output_format,
    from_tool_choice,
    object_schema,
)
from gateway.tool_parsers import TOOL_PARSERS, ToolParsing
from protos import common_pb2


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt: its ids, SamplingParams and block hashes (for routing; [] when the
    gateway does not route by KV)."""

    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams
    block_hashes: list[int]


@dataclass(frozen=True)
class Prepared:
    """A prepared request. session / hints: gateway/sessions.py, gateway/session_hints.py;
    tool_parser: how tool calls are parsed (None: they are not); offered_tools: the request
    offered tools; ignored: the fields nothing reads (gateway/ignored_fields.py);
    structured_param: the field its structured output comes from (named when a worker
    refuses it)."""

    view: RequestView
    prompts: list[PreparedPrompt]
    session: SessionKeys
    hints: SessionHints
    tool_parser: ToolParsing | None = None
    offered_tools: bool = False
    ignored: tuple[str, ...] = ()
    structured_param: str | None = None


@dataclass(frozen=True)
class Routing:
    """What the event loop tells a job of the request: its headers (lower-case names) and
    the KV block size the router hashes prompts by (None: it does not)."""

    headers: dict[str, str]
    block_size: int | None


def prepare(ctx: PrepContext, req: FrontRequest, routing: Routing) -> Prepared:
    """The request, checked and tokenized (steps of the module docstring); GatewayError."""
    require_model(req.model, ctx.settings.model_names)
    session, hints = _session(req, routing)
    field_errors(ctx.settings.limits.check_n, req.params.n, req.names.n)
    parser = _tools(ctx, req)
    params = common_pb2.SamplingParams()
    params.CopyFrom(req.params)
    if parser and TOOL_PARSERS[parser].special_markers:
        params.skip_special_tokens = False  # else the format's marker never reaches the parser
    checker = SchemaChecker(ctx.settings.limits, ctx.note)
    structured, structured_param = field_errors(_structured, req, parser, checker)
    if structured is not None:
        params.structured_output.CopyFrom(structured)
    prompts = _prompts(ctx, req, params, routing.block_size, session.session_id)
    forced = req.tool_choice.mode in ("required", "named")
    parsing = ToolParsing(parser, req.tool_choice.parallel, forced) if parser else None
    return Prepared(req.view, prompts, session, hints, parsing, bool(req.tools), req.ignored,
                    structured_param)


def prompt_token_count(ctx: PrepContext, req: FrontRequest) -> int:
    """The tokens of a chat request's prompt (model, tools and template checked; no
    session, no sampling checks): what Anthropic's count_tokens answers."""
    require_model(req.model, ctx.settings.model_names)
    _tools(ctx, req)
    ctx.note(req.names.prompt)
    tools = [t.openai() for t in req.tools] or None
    try:
        return len(ctx.prompts.chat_token_ids(
            req.prompt.messages, tools, req.prompt.add_generation_prompt,
            continue_final_message=req.prompt.continue_final_message,
            template_kwargs=req.prompt.template_kwargs))
    except PromptError as e:
        raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e


def _session(req: FrontRequest, routing: Routing) -> tuple[SessionKeys, SessionHints]:
    src = req.sessions
    session = session_keys(routing.headers.get, body=src.body, explicit=src.explicit)
    hints = parse_session_hints(routing.headers.get, src.kv_retention, session.session_id)
    if src.end:
        if not session.session_id:
            raise GatewayError(400, "session_end needs a session id", param="session_end",
                               code="invalid_session_hint")
        hints = hints._replace(end=True)
    return session, hints


def _tools(ctx: PrepContext, req: FrontRequest) -> str | None:
    """Check the tools within the limits; the parser's name when calls are parsed."""
    ctx.note("tools")
    limits = ctx.settings.limits
    field_errors(limits.check_tools, len(req.tools))
    for tool in req.tools:
        field_errors(lambda t: limits.schema_text(object_schema(t.parameters, t.param),
                                                  t.param), tool)
    if not req.tools or req.tool_choice.mode == "none":
        return None
    return ctx.settings.tool_call_parser


def _structured(req: FrontRequest, parser: str | None, checker: SchemaChecker
                ) -> tuple[common_pb2.StructuredOutput | None, str | None]:
    """(the grammar, the field it comes from): a forced call in the parser's format, else
    the response format, else the client's own (gRPC); (None, None) for free text."""
    choice = req.tool_choice
    if choice.mode in ("required", "named"):
        tools = [(t.name, t.parameters, t.param) for t in req.tools]
        fmt = TOOL_PARSERS[parser or "hermes"].forced
        return from_tool_choice(tools, choice.mode, choice.name, choice.param, fmt,
                                checker), "tools"
    if req.output_format is not None:
        so = from_output_format(req.output_format.kind, req.output_format.schema,
                                req.output_format.param, checker)
        return so, (req.output_format.param if so is not None else None)
    if req.structured_output is not None:
        check_proto(req.structured_output, checker)
        return req.structured_output, "sampling_params.structured_output"
    return None, None


def _prompts(ctx: PrepContext, req: FrontRequest, params: common_pb2.SamplingParams,
             block_size: int | None, session_id: str) -> list[PreparedPrompt]:
    """Each prompt's ids, SamplingParams and block hashes (GatewayError 400 naming the
    prompt and the field)."""
    prompts = ctx.prompts
    if isinstance(req.prompt, ChatPrompt):
        tools = [t.openai() for t in req.tools] or None
        fns = [lambda: prompts.chat_token_ids(
            req.prompt.messages, tools, req.prompt.add_generation_prompt,
            session_id=session_id, continue_final_message=req.prompt.continue_final_message,
            template_kwargs=req.prompt.template_kwargs)]
    else:
        # several prompts of one session would evict each other: only one is incremental
        cached_as = session_id if len(req.prompt) == 1 else ""
        fns = [_completion_ids(ctx, p, cached_as, req.names.prompt) for p in req.prompt]
    ctx.note(req.names.prompt)
    out = []
    for i, ids_fn in enumerate(fns):
        try:
            ids = truncated(ids_fn(), req.truncate_prompt_tokens, prompts.max_model_len)
            p = finished_params(params, len(ids), prompts.max_model_len, prompts.vocab_size,
                                req.names)
        except (PromptError, RequestError) as e:
            where = f"prompt {i}: " if len(fns) > 1 else ""
            raise GatewayError(400, where + str(e), param=e.param,
                               code="invalid_request") from e
        hashes = ctx.hashes.hashes(ids, block_size, session_id) if block_size else []
        out.append(PreparedPrompt(ids, p, hashes))
    return out


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` token ids (-1: the context
    length; None: all), taken after the chat template. RequestError for 0, or for more than
    the context holds (vLLM's check)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    if not 1 <= keep <= max_model_len:
        raise RequestError(f"truncate_prompt_tokens ({keep}) must be -1 or between 1 and the "
                           f"maximum context length ({max_model_len}).",
                           "truncate_prompt_tokens")
    return ids[-keep:]


def _completion_ids(ctx: PrepContext, prompt: str | list[int], session_id: str,
                    param: str) -> Callable[[], list[int]]:
    if isinstance(prompt, str):
        return lambda: ctx.prompts.text_token_ids(prompt, session_id)
    return lambda: ctx.prompts.check_token_ids(list(prompt), param)


def field_errors(fn: Callable, *args):
    """fn(*args), a RequestError becoming a GatewayError 400 with its field."""
    try:
        return fn(*args)
    except RequestError as e:
        raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e
