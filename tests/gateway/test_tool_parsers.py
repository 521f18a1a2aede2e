"""The named tool-call parsers (gateway/tool_parsers.py): whole outputs, every two-piece split
and token-sized pieces give the same content and calls, and no partial marker leaks out. A
call ends at its closing marker only outside a JSON string (issue 27): arguments quoting the
markers, brackets, escaped quotes and backslashes parse the same at every split."""
from __future__ import annotations

import json

import pytest

from gateway.tool_parsers import TOOL_PARSERS, make_tool_parser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL2 = '{"name": "get_time", "parameters": {"tz": "CET"}}'
# Arguments that quote the formats' own markers (a note about the format itself), brackets,
# an escaped quote and a trailing escaped backslash: the marker inside a string is text.
NOTE = {"text": 'End a call with </tool_call>; a "quote" </tool_call>, [TOOL_CALLS] ]}',
        "path": "C:\\", "more": "<tool_call> <|python_tag|> {\"a\": [1]}"}
NOTE_CALL = json.dumps({"name": "note", "arguments": NOTE})

# parser name → [(output, expected content, expected [(name, arguments)])]
CASES = {
    "hermes": [
        (f"Sure.<tool_call>\n{CALL}\n</tool_call>", "Sure.", [("get_weather", {"city": "Paris"})]),
        (f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL2}</tool_call>", "\n",
         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        (f"<tool_call>[{CALL}, {CALL2}]</tool_call>", "",  # a list in one block
         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        ("<tool_call>not json</tool_call> x", "<tool_call>not json</tool_call> x", []),
        ("a <toolbox> b", "a <toolbox> b", []),
        (f"Noted.<tool_call>\n{NOTE_CALL}\n</tool_call>", "Noted.", [("note", NOTE)]),
        (f"<tool_call>{NOTE_CALL}</tool_call>x<tool_call>{CALL}</tool_call>", "x",
         [("note", NOTE), ("get_weather", {"city": "Paris"})]),
        # arguments as JSON text inside the JSON: parsed; arguments that are no JSON
        # object: not a call, so the text goes out as it came
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
         [("f", {"a": 1})]),
        ('<tool_call>{"name": "f", "arguments": "city=Paris"}</tool_call>',
         '<tool_call>{"name": "f", "arguments": "city=Paris"}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
         '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ],
    "llama3_json": [
        (CALL, "", [("get_weather", {"city": "Paris"})]),
        (f"<|python_tag|>{CALL}; {CALL2}", "",
         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        (f"  \n{CALL2}", "", [("get_time", {"tz": "CET"})]),
        ("The weather is {fine}.", "The weather is {fine}.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        ("<|python", "<|python", []),  # cut off inside the tag: given back
        (f"<|python_tag|>{NOTE_CALL}; {CALL}", "",
         [("note", NOTE), ("get_weather", {"city": "Paris"})]),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{CALL}, {CALL2}]", "",
         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        (f"Let me look.[TOOL_CALLS][{CALL}]", "Let me look.", [("get_weather", {"city": "Paris"})]),
        (f"[TOOL_CALLS] {CALL}", "", [("get_weather", {"city": "Paris"})]),
        ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
        ("[TOOL_CALLS] [{\"name\": ", "[TOOL_CALLS] [{\"name\": ", []),  # cut off: given back
        ("a [TOOL] b", "a [TOOL] b", []),
        (f"See.[TOOL_CALLS] [{NOTE_CALL}, {CALL}] done", "See. done",
         [("note", NOTE), ("get_weather", {"city": "Paris"})]),
    ],
}
MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


def run(name: str, pieces: list[str]) -> tuple[str, list, list[str]]:
    """(content, calls, every content piece emitted) of feeding `pieces`, then finish()."""
    parser = make_tool_parser(name)
    emitted, calls = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        emitted.append(text)
        calls += new
    text, new = parser.finish()
    emitted.append(text)
    calls += new
    assert parser.calls == calls
    return "".join(emitted), calls, emitted


def summary(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_registry():
    assert {"hermes", "llama3_json", "mistral"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="known: hermes"):
        make_tool_parser("nope")


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_two_piece_split(name):
    for output, content, expected in CASES[name]:
        whole, whole_calls, _ = run(name, [output])  # non-streaming: one piece
        assert (whole, summary(whole_calls)) == (content, expected), output
        for cut in range(len(output) + 1):
            text, calls, _ = run(name, [output[:cut], output[cut:]])
            assert (text, summary(calls)) == (whole, summary(whole_calls)), (output, cut)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_three_piece_split_of_a_quoted_marker(name):
    """Both ends of a split next to the quoted markers' and escapes' characters."""
    output = next(o for o, _, e in CASES[name] if e and e[0][0] == "note")
    whole = run(name, [output])[:2]
    lo, hi = output.index("End a call"), output.index("[1]") + 3
    cuts = sorted({i + d for i in range(lo, hi) if output[i] in '"\\<>[]{}|' for d in (0, 1)})
    for a in cuts:
        for b in (c for c in cuts if c >= a):
            text, calls, _ = run(name, [output[:a], output[a:b], output[b:]])
            assert (text, summary(calls)) == (whole[0], summary(whole[1])), (a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_sized_pieces_leak_no_partial_marker(name):
    marker = MARKERS[name]
    for output, content, expected in CASES[name]:
        for size in (1, 2, 3, 5):
            pieces = [output[i:i + size] for i in range(0, len(output), size)]
            text, calls, emitted = run(name, pieces)
            assert (text, summary(calls)) == (content, expected), (output, size)
            if expected:  # a real call: no piece of its marker ever went out as content
                assert not any(marker[:k] in "".join(emitted)
                               for k in range(2, len(marker) + 1)), emitted


def test_calls_get_ids_and_json_arguments():
    _, calls, _ = run("mistral", [f"[TOOL_CALLS][{CALL}, {CALL}]"])
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].to_openai()["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Paris"}'}


def test_streamed_content_is_not_held_longer_than_needed():
    parser = make_tool_parser("llama3_json")
    assert parser.feed("Hello") == ("Hello", [])  # clearly not a call: out at once
    parser = make_tool_parser("mistral")
    assert parser.feed("Hi [TOOL") == ("Hi ", [])
    assert parser.feed("S] x") == ("[TOOLS] x", [])
    parser = make_tool_parser("hermes")
    assert parser.feed("a <tool") == ("a ", [])
