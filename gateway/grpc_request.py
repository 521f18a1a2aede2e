"""The gRPC front's translation: a GatewayGenerateRequest → the front door's FrontRequest, in
the preparation pool (gateway/prep_pool.py runs `prepare_grpc`).

    text / token_ids          → one completion prompt (text tokenized with BOS)
    chat {messages, tools,    → a chat prompt; each tool's parameters_json parsed (400 naming
          tool_choice}          chat.tools[i].parameters_json); tool_choice as HTTP's
    sampling_params           → as sent (max_tokens unset: the room left); its own
                                structured_output checked like a response format's schema
    session_id, session_ttl_seconds, session_end
                              → the session ahead of every header, the retention hint, the
                                last-turn flag (the metadata keys of gateway/sessions.py and
                                gateway/session_hints.py otherwise)
Everything else (session, hints, limits, the forced call's grammar, tokenization, the context
and sampling checks) is the front door's (gateway/front_door.py), as for every HTTP front.
"""
from __future__ import annotations

import json

from gateway.errors import GatewayError
from gateway.front_door import (
    ChatPrompt,
    FrontRequest,
    Prepared,
    RequestView,
    Routing,
    SessionSources,
    ToolChoice,
    ToolSpec,
    prepare,
)
from gateway.prep_pool import PrepContext
from gateway.sampling import FieldNames
from protos import gateway_pb2

STRUCTURED_PARAM = "sampling_params.structured_output"
_NAMES = FieldNames(max_tokens="sampling_params.max_tokens", prompt="prompt",
                    stop="sampling_params.stop", logit_bias="sampling_params.logit_bias",
                    n="sampling_params.n")


def prepare_grpc(ctx: PrepContext, data: bytes, routing: Routing) -> Prepared:
    """A serialized GatewayGenerateRequest, prepared (GatewayError 400 naming the field)."""
    request = gateway_pb2.GatewayGenerateRequest.FromString(data)
    kind = request.WhichOneof("prompt")
    tools: tuple[ToolSpec, ...] = ()
    choice = ToolChoice()
    if kind == "chat":
        prompt = ChatPrompt([_message(m, i) for i, m in enumerate(request.chat.messages)])
        tools = tuple(_tool(t, i) for i, t in enumerate(request.chat.tools))
        choice = _tool_choice(request.chat.tool_choice, not request.chat.HasField(
            "parallel_tool_calls") or request.chat.parallel_tool_calls)
    elif kind == "text":
        prompt = (request.text,)
    elif kind == "token_ids":
        prompt = (list(request.token_ids.ids),)
    else:
        raise GatewayError(400, "a prompt is required (text, token_ids or chat)",
                           param="prompt", code="invalid_request")
    params = request.sampling_params
    so = params.structured_output if params.HasField("structured_output") else None
    ttl = request.session_ttl_seconds if request.HasField("session_ttl_seconds") else None
    front = FrontRequest(
        request.model or None, prompt, params,
        RequestView(request.model, max(1, params.n), True, False,
                    params.logprobs if params.HasField("logprobs") else None),
        tools=tools, tool_choice=choice, structured_output=so,
        sessions=SessionSources(explicit=request.session_id, kv_retention=ttl,
                                end=request.session_end),
        names=_NAMES)
    return prepare(ctx, front, routing)


_ROLES = ("system", "developer", "user", "assistant", "tool")  # gateway.proto's, as HTTP's


def _message(m: gateway_pb2.ChatMessage, index: int) -> dict:
    if m.role not in _ROLES:
        raise GatewayError(400, f"chat.messages[{index}].role must be one of {list(_ROLES)}, "
                                f"got {m.role!r}", param=f"chat.messages[{index}].role",
                           code="invalid_request")
    out: dict = {"role": m.role, "content": m.content if m.HasField("content") else None}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    return out


def _tool(t: gateway_pb2.ToolDefinition, index: int) -> ToolSpec:
    param = f"chat.tools[{index}].parameters_json"
    if not t.name:
        raise GatewayError(400, f"chat.tools[{index}].name is required",
                           param=f"chat.tools[{index}].name", code="invalid_request")
    try:
        parameters = json.loads(t.parameters_json) if t.parameters_json else {}
    except json.JSONDecodeError as e:
        raise GatewayError(400, f"tool {t.name!r}: parameters_json is not JSON: {e}",
                           param=param, code="invalid_request") from e
    return ToolSpec(t.name, t.description, parameters, param)


def _tool_choice(choice: gateway_pb2.ToolChoice, parallel: bool = True) -> ToolChoice:
    param = "chat.tool_choice"
    which = choice.WhichOneof("choice")
    if which == "function_name":
        return ToolChoice("named", choice.function_name, param, parallel)
    mode = choice.mode if which == "mode" else "auto"
    if mode not in ("auto", "none", "required"):
        raise GatewayError(400, 'chat.tool_choice.mode must be "auto", "none" or "required"',
                           param=param, code="invalid_request")
    return ToolChoice(mode, None, param, parallel)
