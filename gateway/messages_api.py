"""Anthropic's Messages API on the gateway, for Claude Code and the `anthropic` clients.

    POST /v1/messages               → a `message` body, or its SSE events (`stream: true`)
    POST /v1/messages/count_tokens  → {"input_tokens": N}

The body is parsed and translated in the preparation pool (gateway/anthropic_protocol.py →
the front door, gateway/front_door.py), dispatched like any request (gateway/relay.py), and
presented by gateway/anthropic_output.py. The key may come as `x-api-key` (Anthropic's
clients) or `Authorization: Bearer` (gateway/asgi.py); errors anywhere under /v1/messages
are in Anthropic's shape (gateway/errors.py). Claude Code's session headers
(x-claude-code-session-id and its agent ids) pick the session (gateway/sessions.py).
"""
from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.anthropic_output import MessagesPresenter
from gateway.anthropic_protocol import count_tokens_job, prepare_messages
from gateway.prompts import PromptBuilder
from gateway.relay import Relay


class MessagesRoutes:
    """The two routes of the module docstring."""

    def __init__(self, relay: Relay, prompts: PromptBuilder) -> None:
        self.relay, self.prompts = relay, prompts

    def add_to(self, app: FastAPI) -> None:
        """Register /v1/messages and /v1/messages/count_tokens on `app`."""
        app.add_api_route("/v1/messages", self.create, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    async def create(self, request: Request) -> Response:
        """One Messages request: stream or collect the answer."""
        prepared = await self.relay.prepare(request, prepare_messages)
        headers = self.relay.headers(prepared, self.prompts.tools_ignored)
        rid = f"msg_{uuid.uuid4().hex}"
        presenter = MessagesPresenter(rid, prepared.view.model,
                                      len(prepared.prompts[0].prompt_token_ids),
                                      prepared.tool_parser)
        return await self.relay.respond(request, prepared, rid, presenter, headers)

    async def count_tokens(self, request: Request) -> JSONResponse:
        """The input tokens the same body would have on /v1/messages."""
        return JSONResponse({"input_tokens": await self.relay.prepare(request,
                                                                       count_tokens_job)})
