"""vLLM's utility endpoints: /tokenize, /detokenize and /version, with vLLM's field names.

    POST /tokenize    {model?, prompt, add_special_tokens? (true), return_token_strs?}
                   or {model?, messages, tools?, add_generation_prompt? (true),
                       continue_final_message? (false), chat_template_kwargs?,
                       add_special_tokens? (false), return_token_strs?}
                   → {"count", "max_model_len", "tokens"} (+ "token_strs" when asked)
    POST /detokenize  {model?, tokens} → {"prompt"}
    GET  /version     → {"version", "workers_dtype": {address: dtype}} (+ "commit" when the
                        gateway runs from a git checkout)

The chat form renders the messages through the chat template exactly as
/v1/chat/completions does, so its count is the prompt_tokens a chat request would be billed.
An unknown model is a 404, an id outside the vocabulary a 400 naming `tokens`. Nothing here
reaches a worker; the work runs in the preparation pool (gateway/prep_pool.py), whose answer
is the response body.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import model_validator

import baton
from gateway.errors import GatewayError, require_model
from gateway.ignored_fields import IgnoredFieldLog, ignored_fields, ignored_header
from gateway.prep_pool import PrepContext, PrepPool
from gateway.prepare import parse_body
from gateway.prompts import PromptError
from gateway.protocol import ChatMessage, Request as Body, Tool


class TokenizeRequest(Body):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: exactly one of
    `prompt` and `messages`. add_special_tokens unset: true for a prompt, false for messages
    (the chat template writes the special tokens itself)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class TokenizeRoutes:
    """The three endpoints; the work is done by the preparation pool (gateway/prep_pool.py)."""

    def __init__(self, max_model_len: int, prep: PrepPool, ignored: IgnoredFieldLog,
                 kv_dtypes=lambda: {}) -> None:
        """kv_dtypes: () -> {worker address: its KV dtype name} from the workers' stats."""
        self.max_model_len = max_model_len
        self.prep = prep
        self.kv_dtypes = kv_dtypes
        self.ignored = ignored
        self.version = {"version": baton.__version__}
        if (commit := baton.source_commit()) is not None:
            self.version["commit"] = commit

    def add_to(self, app: FastAPI) -> None:
        """Register /tokenize, /detokenize and /version on `app`."""
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/version", self.get_version, methods=["GET", "HEAD"])

    async def tokenize(self, request: Request) -> Response:
        """Token ids of a prompt or of templated chat messages (see the module docstring)."""
        return await self._answer(request, tokenize_job)

    async def detokenize(self, request: Request) -> Response:
        """The text of some token ids, special tokens included."""
        return await self._answer(request, detokenize_job)

    async def get_version(self) -> JSONResponse:
        """Baton's version (and the source commit when known), and the dtype each worker
        serves in ("float32" | "bfloat16" | "float16", from its KV layout; `--dtype auto`
        decides it per machine)."""
        return JSONResponse({**self.version, "workers_dtype": self.kv_dtypes()})

    async def _answer(self, request: Request, job) -> Response:
        content, names = await self.prep.run(job, await request.body())
        self.ignored.note(request.url.path, list(names))
        return Response(content, media_type="application/json",
                        headers=ignored_header(list(names)))


Answer = tuple[bytes, tuple[str, ...]]  # the JSON body, the ignored fields


def tokenize_job(ctx: PrepContext, raw: bytes) -> Answer:
    """/tokenize in the preparation pool: GatewayError 400/404 naming the field."""
    body = parse_body(TokenizeRequest, raw)
    require_model(body.model, ctx.settings.model_names)
    prompts = ctx.prompts
    try:
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = prompts.tokenize(body.prompt, special)
        else:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools \
                else None
            ids = prompts.chat_token_ids(messages, tools, body.add_generation_prompt,
                                         bool(body.add_special_tokens),
                                         continue_final_message=body.continue_final_message,
                                         template_kwargs=body.chat_template_kwargs)
    except PromptError as e:
        raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e
    out: dict = {"count": len(ids), "max_model_len": prompts.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = prompts.token_strs(ids)
    return json.dumps(out).encode(), tuple(ignored_fields(body))


def detokenize_job(ctx: PrepContext, raw: bytes) -> Answer:
    """/detokenize in the preparation pool: GatewayError 400 naming `tokens`."""
    body = parse_body(DetokenizeRequest, raw)
    require_model(body.model, ctx.settings.model_names)
    try:
        text = ctx.prompts.detokenize(body.tokens)
    except PromptError as e:
        raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e
    return json.dumps({"prompt": text}).encode(), tuple(ignored_fields(body))
