"""Tool calls in generated text → OpenAI `tool_calls`: the shared pieces and the Hermes parser.

Hermes / Qwen format (also what baton/templates/smollm2_tools.jinja asks for):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Every parser (registry: gateway/tool_parsers.py) is incremental, so streaming and
non-streaming share it: `feed(delta)` returns the content text that is safe to show and the
tool calls completed so far; `finish()` flushes at the end of output. Text that might be the
start of a marker is held back until it is clearly not, so no partial tag leaks into content;
text inside a call is buffered until the call is complete. A call ends at its closing marker
only outside a JSON string (an argument may quote the marker itself: a note about the format),
found by `JsonScan`, which also finds where a JSON value ends; it scans each character once
however the output is cut, so any split of an output parses as the whole does. A call whose
body does not parse as a call is passed through as text; `arguments` is always JSON text.
"""
from __future__ import annotations

import json
import re
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


@dataclass(frozen=True)
class CallFormat:
    """How one forced call is written in a parser's format (gateway/structured.py): prefix,
    the call object {"name": NAME, <arguments_key>: ARGS} (inside a one-element JSON list
    when `as_list`), suffix."""

    prefix: str
    suffix: str
    arguments_key: str = "arguments"
    as_list: bool = False


class ToolParser:
    """The interface every named parser implements (see the module docstring)."""

    name = ""
    # True when the format's markers are special tokens of its models' vocabularies (then the
    # workers must not skip special tokens, or the marker never reaches the parser).
    special_markers = False
    # How a forced call (tool_choice "required" or named) is written in this format.
    forced = CallFormat(OPEN + "\n", "\n" + CLOSE)

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
        self._scan = JsonScan()  # over the open call's body, _buf[0:]

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
                self._scan = JsonScan()
            else:
                j = self._scan.find_outside(self._buf, CLOSE)
                if j is None:
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


class JsonScan:
    """Where JSON text stands, scanned incrementally: inside a string or not, and how deep in
    objects and arrays. Each call continues from where the last stopped, so the text must only
    grow between calls (the same text, more at its end); each character is looked at once
    (regular expressions jump to the next quote, escape, bracket or marker)."""

    _IN_STRING = re.compile(r'["\\]')

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_string = False

    def _string(self, text: str) -> bool:
        """Advance through a string; False when its end is not in `text` yet."""
        while True:
            m = self._IN_STRING.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return False
            if m.group() == '"':
                self.pos, self.in_string = m.end(), False
                return True
            if m.end() == len(text):  # an escape whose character has not come yet
                self.pos = m.start()
                return False
            self.pos = m.end() + 1

    def find_outside(self, text: str, marker: str) -> int | None:
        """Index of the first `marker` outside any JSON string (None while there is none yet;
        a prefix of the marker at the end of `text` is waited on)."""
        outside = re.compile('"|' + re.escape(marker[0]))
        while True:
            if self.in_string and not self._string(text):
                return None
            m = outside.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return None
            if m.group() == '"':
                self.pos, self.in_string = m.end(), True
                continue
            j = m.start()
            if text.startswith(marker, j):
                return j
            if marker.startswith(text[j:]):  # maybe the marker: wait for more text
                self.pos = j
                return None
            self.pos = j + 1

    _OUTSIDE = re.compile(r'["{}\[\]]')

    def value_end(self, text: str) -> int | None:
        """Index just past the JSON object or array that opens `text` (at its first bracket);
        None while it is still open. Brackets count outside strings only; validity is
        json.loads' job."""
        while True:
            if self.in_string and not self._string(text):
                return None
            m = self._OUTSIDE.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return None
            self.pos = m.end()
            ch = m.group()
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return self.pos


def call_from_obj(data: Any) -> ParsedToolCall | None:
    """{"name": str, "arguments" | "parameters": a JSON object, or JSON text of one} → a
    call (else None: it is not a call). `arguments` is always JSON text of an object."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # JSON text inside the JSON (some models write it so)
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"],
                          json.dumps(args, ensure_ascii=False))


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


def json_end(text: str) -> int | None:
    """Index just past the JSON object or array opening at text[0] (None while it is still
    open): a one-off JsonScan.value_end."""
    return JsonScan().value_end(text)
