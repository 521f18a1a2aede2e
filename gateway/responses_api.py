"""OpenAI's Responses API on the gateway, stateless, for Codex and the `openai` clients'
`responses.create` / `responses.stream`.

    POST /v1/responses   → a `response` object, or its SSE events (`stream: true`)

The body is parsed and translated in the preparation pool (gateway/responses_protocol.py →
the front door, gateway/front_door.py), dispatched like any request (gateway/relay.py), and
presented by gateway/responses_output.py. Nothing is stored: every turn sends the whole
conversation in `input` (`store: true` and `previous_response_id` are a 400 saying so).
Errors are in OpenAI's shape. Codex's session headers (thread-id, session-id) and the body's
`prompt_cache_key` pick the session (gateway/sessions.py).
"""
from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.prompts import PromptBuilder
from gateway.relay import Relay
from gateway.responses_output import ResponsesPresenter
from gateway.responses_protocol import prepare_responses


class ResponsesRoutes:
    """POST /v1/responses (see the module docstring)."""

    def __init__(self, relay: Relay, prompts: PromptBuilder) -> None:
        self.relay, self.prompts = relay, prompts

    def add_to(self, app: FastAPI) -> None:
        """Register /v1/responses on `app`."""
        app.add_api_route("/v1/responses", self.create, methods=["POST"])

    async def create(self, request: Request) -> Response:
        """One Responses request: stream or collect the answer."""
        prepared, echo = await self.relay.prepare(request, prepare_responses)
        headers = self.relay.headers(prepared, self.prompts.tools_ignored)
        rid = f"resp_{uuid.uuid4().hex}"
        presenter = ResponsesPresenter(rid, prepared.view.model,
                                       len(prepared.prompts[0].prompt_token_ids),
                                       prepared.tool_parser, echo)
        return await self.relay.respond(request, prepared, rid, presenter, headers)
