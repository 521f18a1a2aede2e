"""The OpenAI chat and completions fronts: a raw body → a FrontRequest → prepared prompts, in
the preparation pool (gateway/prep_pool.py runs these in its children, never on the event loop).

    prepare_chat(ctx, raw, routing) / prepare_completion(ctx, raw, routing):
      1. parse and validate the JSON body (pydantic, gateway/protocol.py; a bad field, or
         fields that do not go together (`check`), → 400 naming it)
      2. translate it into the front door's FrontRequest (gateway/front_door.py): the
         messages or prompts, the sampling fields as the workers' SamplingParams, the tools
         and tool_choice, the response format, the body's session keys
      3. front_door.prepare: model, session and hints, limits, template + tokenize, the
         SamplingParams finished per prompt, block hashes → Prepared
      4. completions' `echo`: each prompt's text (a token-id prompt decoded) in the view,
         for gateway/responses.py to put before the choices' text

Everything raised is a GatewayError carrying the field (`param`), so it can cross the pipe.
`parse_body` and `validation_error` serve every front's body (Anthropic's and the Responses
API's too).
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ValidationError

from baton.chat_format import message_text
from gateway.batch import prompt_list
from gateway.errors import GatewayError
from gateway.front_door import (
    ChatPrompt,
    FrontRequest,
    Prepared,
    PreparedPrompt,
    RequestView,
    Routing,
    field_errors,
    prepare,
)
from gateway.ignored_fields import ignored_fields
from gateway.prep_pool import PrepContext
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.sampling import FieldNames

__all__ = ["Prepared", "PreparedPrompt", "RequestView", "Routing", "parse_body",
           "prepare_chat", "prepare_completion", "validation_error"]

_COMPLETION_NAMES = FieldNames(prompt="prompt")
# The member of a union field pydantic tried, in an error's loc (`prompt.str`,
# `content.list[ContentPart]`, `tool_choice.literal[...]`, a model's class name): not a field
# of the request, so `param` leaves it out. The APIs' field names are lower snake case.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|[a-z-]+\[.*\]|[A-Z]\w*)$")


def validation_error(errors: list[dict]) -> GatewayError:
    """pydantic's errors → a 400 naming the first one's field (`tools[3].function.name`)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return GatewayError(400, "Request body is not valid JSON.", code="invalid_request")
    param = ""
    for part in first.get("loc", ()):
        if part == "body" or (isinstance(part, str) and _UNION_MEMBER.match(part)):
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
    field_errors(body.check)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    front = FrontRequest(
        body.model, ChatPrompt(messages, body.add_generation_prompt,
                               body.continue_final_message, body.chat_template_kwargs),
        field_errors(body.wire_params), body.view(), tools=body.tool_specs(),
        tool_choice=field_errors(body.tool_choice_spec),
        output_format=field_errors(body.output_format), sessions=body.session_sources(),
        ignored=_ignored(body), names=body.field_names(),
        truncate_prompt_tokens=body.truncate_prompt_tokens)
    prepared = prepare(ctx, front, routing)
    # vLLM's rules: without a generation prompt the answer goes on in the last message's
    # role; `echo` puts that message's content first when it is in the answer's role
    role = "assistant" if body.add_generation_prompt or not messages else messages[-1]["role"]
    echo = (message_text(messages[-1].get("content")),) \
        if body.echo and messages and messages[-1]["role"] == role else None
    return replace(prepared, view=replace(prepared.view, role=role, echo=echo))


def prepare_completion(ctx: PrepContext, raw: bytes, routing: Routing) -> Prepared:
    """A /v1/completions body (one or several prompts), prepared."""
    body = parse_body(CompletionRequest, raw)
    field_errors(body.check)
    prompts = tuple(field_errors(prompt_list, body.prompt))
    front = FrontRequest(
        body.model, prompts, field_errors(body.wire_params), body.view(),
        output_format=field_errors(body.output_format), sessions=body.session_sources(),
        ignored=_ignored(body), names=_COMPLETION_NAMES,
        truncate_prompt_tokens=body.truncate_prompt_tokens)
    prepared = prepare(ctx, front, routing)
    if not body.echo:
        return prepared
    # a token-id prompt echoes its text, special tokens included (as vLLM decodes it)
    texts = tuple(p if isinstance(p, str) else ctx.prompts.detokenize(p) for p in prompts)
    return replace(prepared, view=replace(prepared.view, echo=texts,
                                          echo_only=body.max_tokens == 0))


def _ignored(body) -> tuple[str, ...]:
    return tuple(ignored_fields(body, stream_options=body.stream_options))
