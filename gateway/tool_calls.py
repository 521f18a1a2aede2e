"""Tool calls in generated text → OpenAI `tool_calls` (Hermes / Qwen format).

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Incremental, so streaming and non-streaming share it: `feed(delta)` returns the content text
that is safe to show and the tool calls completed so far. Text that might be the start of
`<tool_call>` is held back until it is clearly not; text inside a call is buffered until its
closing tag. A call whose body is not a JSON object with a "name" is passed through as text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """Add generated text; return (content to emit, tool calls completed by it)."""
        self._buf += text
        out: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    out.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.append(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(OPEN):], True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    break
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(CLOSE):], False
                call = parse_call(body)
                if call is None:
                    out.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
        self.calls += calls
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """End of output: a call cut off before its closing tag still counts if it parses."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = parse_call(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return OPEN + rest, []
        return rest, []


def parse_call(body: str) -> ParsedToolCall | None:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], args)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
