"""Decode-worker messages → Anthropic Messages API output: one `message` body, or its SSE events.

    TokenChunk text  ─▶ (the tool-call parser, when tools were offered) ─▶ text blocks
    parsed calls     ─▶ tool_use blocks {id "toolu_...", name, input}
    Finished         ─▶ stop_reason: a call was parsed → "tool_use"; a stop string →
                        "stop_sequence" (+ stop_sequence); max_tokens → "max_tokens";
                        else "end_turn". ERROR / ABORT → the error (a stream: an error event)
    usage            ─▶ input_tokens (prompt tokens not read from a cache, as Anthropic
                        counts them), cache_read_input_tokens (the workers' cached_tokens;
                        the two sum to the prompt's length), cache_creation_input_tokens 0,
                        output_tokens

A stream is: message_start (sent with the first piece of output, whose prompt usage, from
the decode worker's first chunk, it states: the same split message_delta ends with), ping,
then per block content_block_start, content_block_delta
(text_delta; a tool call's whole input in one input_json_delta, since calls are parsed
whole), content_block_stop; then message_delta (stop_reason, stop_sequence, the final usage)
and message_stop. A failure after the start is `event: error` and the stream ends.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from gateway.answer import pieces, whole
from gateway.errors import GatewayError, anthropic_error_body, error_code_of
from gateway.tool_calls import ParsedToolCall
from gateway.tool_parsers import ToolParsing
from protos import common_pb2

_LENGTH = common_pb2.FINISH_REASON_LENGTH


def sse(name: str, data: dict) -> bytes:
    """One SSE event with its name, as Anthropic sends them."""
    return f"event: {name}\ndata: ".encode() + json.dumps(
        data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def tool_use(call: ParsedToolCall) -> dict:
    """A parsed call as a tool_use block (ids in Anthropic's `toolu_` form)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments)}


def usage(u: common_pb2.Usage | None, prompt_len: int, counted: int) -> dict:
    """Anthropic's usage from a worker's Usage (the gateway's own counts where the worker
    sent none)."""
    u = u if u is not None else common_pb2.Usage()
    prompt = u.prompt_tokens or prompt_len
    return {"input_tokens": prompt - u.cached_tokens, "output_tokens":
            u.completion_tokens or counted, "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0}


def stop(finished, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion."""
    if finished.finish_reason == _LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if finished.WhichOneof("stop_reason") == "stop_str":
        return "stop_sequence", finished.stop_str
    return "end_turn", None


class MessagesPresenter:
    """One /v1/messages answer for gateway/relay.py (see the module docstring)."""

    def __init__(self, message_id: str, model: str, prompt_len: int,
                 tool_parser: ToolParsing | None) -> None:
        self.message_id, self.model, self.prompt_len = message_id, model, prompt_len
        self.tool_parser = tool_parser

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None,
                 usage_: dict) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage_}

    async def collect(self, messages: AsyncIterator) -> dict:
        """The `message` body (GatewayError when the worker failed the request)."""
        content, calls, f, counted = await whole(messages, self.tool_parser)
        # no empty text block (Anthropic's API never answers one and refuses one sent back:
        # an agent appending this content to its history got a 400 on its next turn); an
        # empty answer is `content: []`, as the stream's (no content block) already was
        text = content.strip() or (content and not calls)
        blocks = ([{"type": "text", "text": content}] if text else []) + \
            [tool_use(c) for c in calls]
        return self._message(blocks, *stop(f, bool(calls)),
                             usage(f.usage, self.prompt_len, counted))

    async def events(self, messages: AsyncIterator) -> AsyncIterator[bytes]:
        """The SSE events of the module docstring."""
        blocks, started = _Blocks(), False
        async for piece in pieces(messages, self.tool_parser):
            if not started:  # no wait: the relay holds the first message before answering
                started = True
                start = usage(piece.prompt_usage, self.prompt_len, 0)
                yield sse("message_start", {"type": "message_start",
                                            "message": self._message([], None, None, start)})
                yield sse("ping", {"type": "ping"})
            if piece.error is not None:
                yield self.end_error(piece.error)
                return
            for event in blocks.add(piece.text, piece.calls):
                yield event
            if piece.finished is None:
                continue
            for event in blocks.close():
                yield event
            reason, sequence = stop(piece.finished, blocks.called)
            yield sse("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(piece.finished.usage, self.prompt_len, piece.counted)})
            yield sse("message_stop", {"type": "message_stop"})

    def end_error(self, error: GatewayError) -> bytes:
        """An `error` event (Anthropic's error body)."""
        return sse("error", anthropic_error_body(error.status, error.message, error.param))

    def error_code(self, event: bytes) -> str | None:
        """The error type of an `error` event, else None."""
        return error_code_of(event) if event.startswith(b"event: error") else None


class _Blocks:
    """The content blocks of one streamed message: a text block stays open while text comes;
    a tool call closes it and is a block of its own."""

    def __init__(self) -> None:
        self.index = -1
        self.text_open = False
        self.called = False

    def add(self, text: str, calls: list[ParsedToolCall]) -> list[bytes]:
        out = []
        if text:
            if not self.text_open:
                self.index += 1
                self.text_open = True
                out.append(sse("content_block_start", {
                    "type": "content_block_start", "index": self.index,
                    "content_block": {"type": "text", "text": ""}}))
            out.append(sse("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "text_delta", "text": text}}))
        for call in calls:
            out += self.close()
            self.index += 1
            self.called = True
            block = tool_use(call)
            out.append(sse("content_block_start", {
                "type": "content_block_start", "index": self.index,
                "content_block": {**block, "input": {}}}))
            out.append(sse("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
            out.append(sse("content_block_stop", {"type": "content_block_stop",
                                                  "index": self.index}))
        return out

    def close(self) -> list[bytes]:
        """Close the open text block, if any."""
        if not self.text_open:
            return []
        self.text_open = False
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]
