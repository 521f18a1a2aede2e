"""Decode-worker messages → OpenAI Responses API output: one `response` object, or its events.

    TokenChunk text  ─▶ (the tool-call parser, when tools were offered) ─▶ a `message` item
                        {id "msg_...", content [{type "output_text", text}]}
    parsed calls     ─▶ `function_call` items {id "fc_...", call_id "call_...", name, arguments}
    Finished         ─▶ status "completed"; max_output_tokens reached → "incomplete" with
                        incomplete_details {reason "max_output_tokens"}
    usage            ─▶ input_tokens, input_tokens_details.cached_tokens (the workers'),
                        output_tokens, total_tokens

A stream (each event with its `sequence_number`): response.created, response.in_progress;
per message item response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done; per call response.output_item.added,
response.function_call_arguments.delta (the whole arguments: calls are parsed whole),
response.function_call_arguments.done, response.output_item.done; then response.completed
(or response.incomplete) with the whole response. A failure after the start (a worker's
error, the shutdown deadline) is response.failed with the response's `error`, and the stream
ends. The server is stateless: `store` is false in every response.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from gateway.answer import pieces, whole
from gateway.errors import GatewayError, error_code_of
from gateway.responses_protocol import Echo
from gateway.tool_calls import ParsedToolCall
from gateway.tool_parsers import ToolParsing
from protos import common_pb2


def usage(finished, prompt_len: int, counted: int) -> dict:
    """The Responses API's usage of a finished request."""
    u = finished.usage if finished is not None else common_pb2.Usage()
    prompt, output = u.prompt_tokens or prompt_len, u.completion_tokens or counted
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status != "in_progress" or text else []}


def call_item(call: ParsedToolCall, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call",
            "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}


class ResponsesPresenter:
    """One /v1/responses answer for gateway/relay.py (see the module docstring)."""

    def __init__(self, response_id: str, model: str, prompt_len: int,
                 tool_parser: ToolParsing | None, echo: Echo) -> None:
        self.response_id, self.model, self.prompt_len = response_id, model, prompt_len
        self.tool_parser, self.echo = tool_parser, echo
        self.created_at = int(time.time())
        self.seq = 0

    def response(self, status: str, output: list, usage_: dict | None,
                 incomplete: bool = False, error: dict | None = None) -> dict:
        """The Response object."""
        e = self.echo
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "usage": usage_,
                "error": error, "incomplete_details":
                    {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": e.instructions, "tool_choice": e.tool_choice,
                "tools": list(e.tools), "parallel_tool_calls": e.parallel_tool_calls,
                "temperature": e.temperature, "top_p": e.top_p,
                "max_output_tokens": e.max_output_tokens,
                "text": {"format": e.text_format}, "store": False,
                "previous_response_id": None, "metadata": e.metadata or {}}

    async def collect(self, messages: AsyncIterator) -> dict:
        """The `response` object (GatewayError when the worker failed the request)."""
        content, calls, f, counted = await whole(messages, self.tool_parser)
        incomplete = f.finish_reason == common_pb2.FINISH_REASON_LENGTH
        output = ([message_item(f"msg_{uuid.uuid4().hex}", content,
                                "incomplete" if incomplete else "completed")]
                  if content.strip() or not calls else []) + [call_item(c) for c in calls]
        return self.response("incomplete" if incomplete else "completed", output,
                             usage(f, self.prompt_len, counted), incomplete)

    def event(self, kind: str, **data) -> bytes:
        """One SSE event, numbered."""
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(
            body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    async def events(self, messages: AsyncIterator) -> AsyncIterator[bytes]:
        """The events of the module docstring."""
        yield self.event("response.created", response=self.response("in_progress", [], None))
        yield self.event("response.in_progress",
                         response=self.response("in_progress", [], None))
        items = _Items(self)
        async for piece in pieces(messages, self.tool_parser):
            if piece.error is not None:
                yield self.end_error(piece.error, items.output)
                return
            for event in items.add(piece.text, piece.calls):
                yield event
            if piece.finished is None:
                continue
            incomplete = piece.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            status = "incomplete" if incomplete else "completed"
            for event in items.close(status):  # a message cut by max_output_tokens: incomplete
                yield event
            yield self.event(f"response.{status}", response=self.response(
                status, items.output, usage(piece.finished, self.prompt_len, piece.counted),
                incomplete))

    def end_error(self, error: GatewayError, output: list | None = None) -> bytes:
        """response.failed, the error in the response."""
        return self.event("response.failed", response=self.response(
            "failed", output or [], None, error={"code": error.code or "server_error",
                                                 "message": error.message}))

    def error_code(self, event: bytes) -> str | None:
        """The error code of a response.failed event, else None."""
        return error_code_of(event) if event.startswith(b"event: response.failed") else None


class _Items:
    """The output items of one streamed response: a message item stays open while text
    comes; a call closes it and is an item of its own."""

    def __init__(self, presenter: ResponsesPresenter) -> None:
        self.p = presenter
        self.output: list[dict] = []
        self.text: list[str] | None = None  # the open message's text
        self.item_id = ""

    def add(self, text: str, calls: list[ParsedToolCall]) -> list[bytes]:
        ev, out = self.p.event, []
        if text:
            if self.text is None:
                self.text, self.item_id = [], f"msg_{uuid.uuid4().hex}"
                out.append(ev("response.output_item.added", output_index=len(self.output),
                              item=message_item(self.item_id, "", "in_progress")))
                out.append(ev("response.content_part.added", item_id=self.item_id,
                              output_index=len(self.output), content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []}))
            self.text.append(text)
            out.append(ev("response.output_text.delta", item_id=self.item_id,
                          output_index=len(self.output), content_index=0, delta=text,
                          logprobs=[]))
        for call in calls:
            out += self.close()
            index, item = len(self.output), call_item(call)
            out.append(ev("response.output_item.added", output_index=index,
                          item=call_item(call, "in_progress")))
            out.append(ev("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=index, delta=call.arguments))
            out.append(ev("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, name=call.name, arguments=call.arguments))
            out.append(ev("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """Close the open message item, if any, with `status` ("incomplete": the response
        ended at max_output_tokens, OpenAI's item status for a cut message)."""
        if self.text is None:
            return []
        ev, index, text = self.p.event, len(self.output), "".join(self.text)
        item = message_item(self.item_id, text, status)
        self.text = None
        self.output.append(item)
        return [ev("response.output_text.done", item_id=item["id"], output_index=index,
                   content_index=0, text=text, logprobs=[]),
                ev("response.content_part.done", item_id=item["id"], output_index=index,
                   content_index=0, part=item["content"][0]),
                ev("response.output_item.done", output_index=index, item=item)]
