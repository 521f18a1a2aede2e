"""Tool calls in generated text → OpenAI `tool_calls`: the shared pieces and the Hermes parser.

Hermes / Qwen format (also what gateway/templates/smollm2_tools.jinja asks for):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Every parser (registry: gateway/tool_parsers.py) is incremental, so streaming and
non-streaming share it: `feed(delta)` returns the content text that is safe to show and the
tool calls completed so far; `finish()` flushes at the end of output. Text that might be the
start of a marker is held back until it is clearly not, so no partial tag leaks into content;
text inside a call is buffered until the call is complete. A call whose body does not parse
as a call is passed through as text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Fed = tuple[str, list[ParsedToolCall]]  # (content to emit, tool calls completed)


class ToolParser:
    """The interface every named parser implements (see the module docstring)."""

    name = ""
    # True when the format's markers are special tokens of its models' vocabularies (then the
    # workers must not skip special tokens, or the marker never reaches the parser).
    special_markers = False

    def __init__(self) -> None:
        self.calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> Fed:
        """Add generated text; return (content to emit, tool calls completed by it)."""
        raise NotImplementedError

    def finish(self) -> Fed:
        """End of output: flush held-back text (and a call that parses though unclosed)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the output; a block may hold one
    call object or a JSON list of them."""

    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> Fed:
        self._buf += text
        out: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_call:
                content, self._buf, self._in_call = until_marker(self._buf, OPEN)
                out.append(content)
                if not self._in_call:
                    break
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    break
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(CLOSE):], False
                parsed = parse_calls(body)
                if parsed is None:
                    out.append(OPEN + body + CLOSE)
                else:
                    calls += parsed
        self.calls += calls
        return "".join(out), calls

    def finish(self) -> Fed:
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            parsed = parse_calls(rest)
            if parsed is not None:
                self.calls += parsed
                return "", parsed
            return OPEN + rest, []
        return rest, []


def call_from_obj(data: Any) -> ParsedToolCall | None:
    """{"name": str, "arguments" | "parameters": object or JSON text} → a call (else None)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], args)


def parse_calls(body: str) -> list[ParsedToolCall] | None:
    """JSON text of one call object or a non-empty list of them → calls (None if it is not)."""
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) and data else [data]
    calls = [call_from_obj(item) for item in items]
    return None if any(c is None for c in calls) else calls


def until_marker(text: str, marker: str) -> tuple[str, str, bool]:
    """(text before `marker`, text after it, True) when `text` holds the marker; else (the
    text that cannot be part of it, the held-back suffix that may start it, False)."""
    i = text.find(marker)
    if i >= 0:
        return text[:i], text[i + len(marker):], True
    keep = partial_suffix(text, marker)
    return text[:len(text) - keep], text[len(text) - keep:], False


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def json_end(text: str, start: int = 0) -> int | None:
    """Index just past the JSON object or array opening at text[start] (None while it is
    still open). Counts brackets outside strings only; validity is json.loads' job."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
