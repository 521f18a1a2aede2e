"""One completion's output as text and parsed tool calls, for the fronts that present a single
answer (Anthropic Messages: gateway/anthropic_output.py; OpenAI Responses:
gateway/responses_output.py).

    pieces(messages, parser) ─▶ Piece(text, calls, counted) per TokenChunk, through the tool-call
                                parser when one is named (gateway/tool_parsers.py; any split of
                                the output parses as the whole does; the first with the
                                prompt's usage when the worker sent it), then a last Piece
                                with the Finished (and its error, for ERROR / ABORT) and what
                                the parser held back
    whole(messages, parser)  ─▶ (text, calls, Finished, output tokens); GatewayError for a
                                failed request
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.errors import GatewayError
from gateway.responses import finished_error
from gateway.tool_calls import ParsedToolCall
from gateway.tool_parsers import ToolParsing
from protos import common_pb2


@dataclass
class Piece:
    """Text to show and calls completed by one message; `finished` on the last one (with
    `error` when the request failed); `counted`: output tokens so far; `prompt_usage`: the
    prompt's Usage, on the chunk that carried it (the first), or the Finished's."""

    text: str
    calls: list[ParsedToolCall] = field(default_factory=list)
    counted: int = 0
    finished: object = None
    error: GatewayError | None = None
    prompt_usage: common_pb2.Usage | None = None


async def pieces(messages: AsyncIterator, tool_parser: ToolParsing | None
                 ) -> AsyncIterator[Piece]:
    """The pieces of the module docstring; ends after the Finished."""
    parser = tool_parser.new() if tool_parser else None
    counted = 0
    async for msg in messages:
        if msg.WhichOneof("kind") == "tokens":
            t = msg.tokens
            counted += len(t.token_ids)
            text, calls = t.text_delta, []
            if parser is not None:
                text, calls = parser.feed(text)
            yield Piece(text, calls, counted,
                        prompt_usage=t.prompt_usage if t.HasField("prompt_usage") else None)
            continue
        f = msg.finished
        if (error := finished_error(f)) is not None:
            yield Piece("", [], counted, f, error, f.usage)
            return
        tail, calls = parser.finish() if parser is not None else ("", [])
        yield Piece(tail, calls, counted, f, prompt_usage=f.usage)
        return
    raise GatewayError(502, "the decode worker ended the stream without finishing",
                       code="upstream_error")


async def whole(messages: AsyncIterator, tool_parser: ToolParsing | None
                ) -> tuple[str, list[ParsedToolCall], object, int]:
    """(text, calls, the Finished, output tokens) of the answer; GatewayError when the
    worker failed the request."""
    text: list[str] = []
    calls: list[ParsedToolCall] = []
    async for piece in pieces(messages, tool_parser):
        if piece.error is not None:
            raise piece.error
        text.append(piece.text)
        calls += piece.calls
        if piece.finished is not None:
            return "".join(text), calls, piece.finished, piece.counted
    raise AssertionError("pieces() ends with the Finished or raises")  # pragma: no cover
