"""One choice of an OpenAI answer as its chunks arrive: text, token count, logprobs (with
an echoed prompt's), tool calls parsed from the text, finish reason (gateway/responses.py)."""
from __future__ import annotations

from gateway.logprobs_output import TextOffsets
from gateway.tool_calls import ParsedToolCall
from gateway.tool_parsers import ToolParsing
from protos import common_pb2

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


class Choice:
    """Choice `index` (prompt index × n + j); echo: its prompt's text, put before its own."""

    def __init__(self, index: int, tool_parser: ToolParsing | None, echo: str = "") -> None:
        self.index = index
        self.text: list[str] = [echo] if echo else []
        self.unsent_echo = echo  # a stream sends it with the choice's first chunk
        self.num_tokens = 0
        self.logprobs: list[common_pb2.TokenLogprobs] = []
        self.parser = tool_parser.new() if tool_parser else None
        self.tool_calls: list[ParsedToolCall] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.head: int | None = None  # the echoed prompt's first token (logprobs: null)
        self.prompt_lps: list[common_pb2.TokenLogprobs] = []
        self.text_offsets = TextOffsets()  # a stream's legacy text_offset, across chunks

    def new_logprobs(self, spec, t) -> list:
        """The logprobs TokenChunk `t` adds (spec: the OutputSpec) to the choice (call before counting its tokens):
        its first chunk keeps the prompt's, which lead when they are echoed; echo_only
        drops the generated token's."""
        out = []
        if self.num_tokens == 0:
            self.prompt_lps = list(t.prompt_logprobs)
            if spec.echo_logprobs:
                self.head = spec.prompt_heads[self.index // spec.n]
                out = list(self.prompt_lps)
        if not spec.echo_only:
            out.extend(t.logprobs)
        return out

    def finish(self, f) -> None:
        """Its Finished message `f` (a normal end: stop or length)."""
        self.finish_reason = FINISH[f.finish_reason]
        self.stop_reason = getattr(f, f.WhichOneof("stop_reason")) if f.WhichOneof(
            "stop_reason") else None
        if self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"

    def echoed(self, text: str) -> str:
        """`text`, after the echoed prompt if that is not sent yet."""
        out, self.unsent_echo = self.unsent_echo + text, ""
        return out
