"""Named tool-call parsers (`--tool-call-parser NAME`), as vLLM names them.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (gateway/tool_calls.py)
    llama3_json  {"name": ..., "parameters": {...}} as the whole output, possibly after
                 <|python_tag|>; several calls separated by ";"
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

All share the incremental contract of gateway/tool_calls.py (`feed` / `finish`, nothing
partial leaks into content).
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_calls import (
    CallFormat,
    Fed,
    HermesParser,
    JsonScan,
    ParsedToolCall,
    ToolParser,
    parse_calls,
    until_marker,
)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS_TAG = "[TOOL_CALLS]"


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: only an output that *starts* (after whitespace) with `{` or
    `<|python_tag|>` is a call; anything else is content from its first character on."""

    name = "llama3_json"
    special_markers = True
    forced = CallFormat("", "", arguments_key="parameters")

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._state = "start"  # start → calls → content (for good) | start → content
        self._scan = JsonScan()  # over the call object that opens _buf

    def feed(self, text: str) -> Fed:
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return "", []
            if head.startswith(PYTHON_TAG):
                self._buf, self._state = head[len(PYTHON_TAG):], "calls"
            elif head.startswith("{"):
                self._buf, self._state = head, "calls"
            else:
                self._state = "content"
        if self._state == "content":
            out, self._buf = self._buf, ""
            return out, []
        return self._calls()

    def _calls(self) -> Fed:
        calls: list[ParsedToolCall] = []
        while True:
            rest = self._buf.lstrip().lstrip(";").lstrip()
            if len(rest) != len(self._buf):  # separators dropped: a new call starts
                self._buf, self._scan = rest, JsonScan()
            if not rest:
                break
            end = self._scan.value_end(rest) if rest.startswith("{") else -1
            if end is None:
                break  # the object is still open
            parsed = parse_calls(rest[:end]) if end > 0 else None
            if parsed is None:  # not a call after all: the rest is content
                self._state, self._buf = "content", ""
                self.calls += calls
                return rest, calls
            calls += parsed
            self._buf, self._scan = rest[end:], JsonScan()
        self.calls += calls
        return "", calls

    def finish(self) -> Fed:
        rest, self._buf = self._buf, ""
        return rest, []


class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` followed by a JSON array of calls (or one call object);
    content may come before it."""

    name = "mistral"
    special_markers = True
    forced = CallFormat(TOOL_CALLS_TAG, "", as_list=True)

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._in_calls = False
        self._scan = JsonScan()  # over the calls after the tag, _buf[0:]

    def feed(self, text: str) -> Fed:
        self._buf += text
        out: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_calls:
                content, self._buf, self._in_calls = until_marker(self._buf, TOOL_CALLS_TAG)
                out.append(content)
                if not self._in_calls:
                    break
                self._scan = JsonScan()
                continue
            body = self._buf.lstrip()
            end = self._scan.value_end(self._buf) if body[:1] in ("[", "{") else -1
            if not body or end is None:
                break  # the array is still open
            parsed = parse_calls(self._buf[:end]) if end > 0 else None
            if parsed is None:
                out.append(TOOL_CALLS_TAG + self._buf)
                self._buf = ""
            else:
                calls += parsed
                self._buf = self._buf[end:]
            self._in_calls = False
        self.calls += calls
        return "".join(out), calls

    def finish(self) -> Fed:
        rest, self._buf = self._buf, ""
        if self._in_calls:
            self._in_calls = False
            return TOOL_CALLS_TAG + rest, []
        return rest, []


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


class _Wrapped(ToolParser):
    """Another parser's output, passed through `_pass` (at the end of output `end` is True);
    the wrapper takes the inner parser's format attributes and keeps its own `calls`."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self.inner = parser
        self.name, self.special_markers, self.forced = \
            parser.name, parser.special_markers, parser.forced

    def _pass(self, fed: Fed, end: bool) -> Fed:
        raise NotImplementedError

    def feed(self, text: str) -> Fed:
        return self._record(self._pass(self.inner.feed(text), end=False))

    def finish(self) -> Fed:
        return self._record(self._pass(self.inner.finish(), end=True))

    def _record(self, fed: Fed) -> Fed:
        self.calls += fed[1]
        return fed


class FirstCallOnly(_Wrapped):
    """`parser`, keeping only the first tool call of the output: the request said
    `parallel_tool_calls: false` (OpenAI) or `disable_parallel_tool_use: true` (Anthropic).
    Later calls are dropped, text and all; content is passed through (what vLLM does)."""

    def _pass(self, fed: Fed, end: bool) -> Fed:
        text, calls = fed
        return text, calls[:max(0, 1 - len(self.calls))]


class ForcedCall(_Wrapped):
    """`parser` for an output the grammar forces to be one call (tool_choice "required" or
    named: gateway/structured.py), so it holds no content: a call cut by max_tokens, which
    `finish` would flush as text (`<tool_call>\n{"name": "`), is dropped instead; the
    choice ends with no content and no call, and finish_reason "length" says why. Before,
    the fragment of the format's markup reached the client as the assistant's text."""

    def _pass(self, fed: Fed, end: bool) -> Fed:
        return ("", fed[1]) if end else fed


def make_tool_parser(name: str, parallel: bool = True, forced: bool = False) -> ToolParser:
    """A fresh parser of the named format (ValueError naming the known ones); parallel
    False: only its first call is kept (FirstCallOnly); forced: the grammar forces a call,
    and an unfinished one is dropped at the end, not shown as text (ForcedCall)."""
    try:
        parser = TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
    parser = ForcedCall(parser) if forced else parser
    return parser if parallel else FirstCallOnly(parser)


@dataclass(frozen=True)
class ToolParsing:
    """How a request's tool calls are parsed: the parser's `name` (TOOL_PARSERS), whether
    parallel calls are returned (False: the first only) and whether the grammar forces a
    call (tool_choice "required" or named)."""

    name: str
    parallel: bool = True
    forced: bool = False

    def new(self) -> ToolParser:
        """A fresh parser for one choice."""
        return make_tool_parser(self.name, self.parallel, self.forced)
