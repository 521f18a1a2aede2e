"""An HTTP request from raw body to tokenized, checked prompts: the preparation pool's work
(gateway/prep_pool.py runs these in its children, never on the event loop).

    prepare_chat(ctx, raw) / prepare_completion(ctx, raw):
      1. parse and validate the JSON body (pydantic; a bad field → 400 naming it)
      2. model check (404); chat: the tools within the limits, each `parameters` an object
         schema (gateway/limits.py, gateway/structured.py)
      3. template + tokenize each prompt (gateway/prompts.py), noted as `messages` / `prompt`
      4. SamplingParams (gateway/protocol.py): the context check, the structured output with
         its schemas checked (each noted by its field)
      5. the session (headers, else `user`) and its hints; each prompt's block hashes for the
         router (the child's cache of the session's last prompt saves the shared prefix)
    → Prepared: the prompts, the session, and the few body fields the event loop still needs
      (RequestView)

Everything raised is a GatewayError carrying the field (`param`), so it can cross the pipe.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.batch import prompt_list
from gateway.errors import GatewayError, RequestError, require_model
from gateway.ignored_fields import ignored_fields
from gateway.prep_pool import PrepContext
from gateway.prompts import PromptError
from gateway.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from gateway.session_hints import SessionHints, parse_session_hints
from gateway.sessions import SessionKeys, session_keys
from gateway.structured import SchemaChecker
from gateway.tool_parsers import TOOL_PARSERS
from protos import common_pb2


@dataclass(frozen=True)
class RequestView:
    """The body fields the event loop reads once the request is prepared."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    num_logprobs: int | None


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt: its ids, SamplingParams and block hashes (for routing; [] when the
    gateway does not route by KV)."""

    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams
    block_hashes: list[int]


@dataclass(frozen=True)
class Prepared:
    """A prepared request. session / hints: from the headers and the body (gateway/
    sessions.py, gateway/session_hints.py); tool_parser: the parser's name when tool calls
    are parsed; offered_tools: the request offered tools; ignored: the fields nothing reads
    (gateway/ignored_fields.py)."""

    view: RequestView
    prompts: list[PreparedPrompt]
    session: SessionKeys
    hints: SessionHints
    tool_parser: str | None = None
    offered_tools: bool = False
    ignored: tuple[str, ...] = ()
    structured_param: str | None = None  # where the structured output comes from


@dataclass(frozen=True)
class Routing:
    """What the event loop tells a job of the request: its headers (lower-case names) and
    the KV block size the router hashes prompts by (None: it does not)."""

    headers: dict[str, str]
    block_size: int | None


def validation_error(errors: list[dict]) -> GatewayError:
    """pydantic's errors → a 400 naming the first one's field (`tools[3].function.name`)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return GatewayError(400, "Request body is not valid JSON.", code="invalid_request")
    param = ""
    for part in first.get("loc", ()):
        if part == "body":
            continue
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    message = first.get("msg", "invalid request") + (f" ({param})" if param else "")
    return GatewayError(400, message, param=param or None, code="invalid_request")


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """The body as `model` (GatewayError 400 naming the field when it does not fit)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def prepare_chat(ctx: PrepContext, raw: bytes, routing: Routing) -> Prepared:
    """A /v1/chat/completions body, prepared (see the module docstring)."""
    body = parse_body(ChatCompletionRequest, raw)
    require_model(body.model, ctx.settings.model_names)
    session, hints = _session(body, routing)
    ctx.note("tools")
    _field_errors(body.check_tools, ctx.settings.limits)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    parser = ctx.settings.tool_call_parser if body.parse_tool_calls else None
    if parser and TOOL_PARSERS[parser].special_markers:
        body.skip_special_tokens = False  # else the format's marker never reaches the parser
    ctx.note("messages")
    prompts = _prompts(ctx, body, [functools.partial(
        ctx.prompts.chat_token_ids, messages, tools, body.add_generation_prompt)],
        routing.block_size, session.session_id)
    return Prepared(_view(body), prompts, session, hints, parser, bool(tools),
                    _ignored(body), body.structured_param)


def prepare_completion(ctx: PrepContext, raw: bytes, routing: Routing) -> Prepared:
    """A /v1/completions body (one or several prompts), prepared."""
    body = parse_body(CompletionRequest, raw)
    require_model(body.model, ctx.settings.model_names)
    session, hints = _session(body, routing)
    texts = _field_errors(prompt_list, body.prompt)
    ctx.note("prompt")
    fns = [functools.partial(_completion_ids, ctx, p) for p in texts]
    # several prompts of one session would evict each other's hashes: only one is cached
    cached_as = session.session_id if len(fns) == 1 else ""
    prompts = _prompts(ctx, body, fns, routing.block_size, cached_as)
    return Prepared(_view(body), prompts, session, hints, ignored=_ignored(body),
                    structured_param=body.structured_param)


def _session(body, routing: Routing) -> tuple[SessionKeys, SessionHints]:
    """The request's session (headers, else `user`) and its hints (GatewayError 400)."""
    session = session_keys(routing.headers.get, body.user)
    return session, parse_session_hints(routing.headers.get, body.kv_retention,
                                        session.session_id)


def _completion_ids(ctx: PrepContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return ctx.prompts.text_token_ids(prompt)
    return ctx.prompts.check_token_ids(list(prompt))


def _prompts(ctx: PrepContext, body, ids_fns: list[Callable[[], list[int]]],
             block_size: int | None, session_id: str) -> list[PreparedPrompt]:
    """Each prompt's ids, SamplingParams and block hashes (GatewayError 400 naming the
    prompt and field)."""
    checker = SchemaChecker(ctx.settings.limits, ctx.note)
    out = []
    for i, ids_fn in enumerate(ids_fns):
        try:
            ids = ids_fn()
            params = to_sampling_params(body, body.num_logprobs, len(ids),
                                        ctx.prompts.max_model_len, ctx.prompts.vocab_size,
                                        checker)
        except (PromptError, RequestError) as e:
            where = f"prompt {i}: " if len(ids_fns) > 1 else ""
            raise GatewayError(400, where + str(e), param=e.param,
                               code="invalid_request") from e
        hashes = ctx.hashes.hashes(ids, block_size, session_id) if block_size else []
        out.append(PreparedPrompt(ids, params, hashes))
    return out


def _field_errors(fn: Callable, *args):
    """fn(*args), a RequestError becoming a GatewayError 400 with its field."""
    try:
        return fn(*args)
    except RequestError as e:
        raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e


def _view(body) -> RequestView:
    return RequestView(body.model, body.n, body.stream, body.include_usage, body.num_logprobs)


def _ignored(body) -> tuple[str, ...]:
    return tuple(sorted(ignored_fields(body, stream_options=body.stream_options)
                        + body.unenforced_fields))
