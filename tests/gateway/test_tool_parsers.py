"""The named tool-call parsers (gateway/tool_parsers.py): whole outputs, every two-piece split
and token-sized pieces give the same content and calls, and no partial marker leaks out."""
from __future__ import annotations

import json

import pytest

from gateway.tool_parsers import TOOL_PARSERS, make_tool_parser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL2 = '{"name": "get_time", "parameters": {"tz": "CET"}}'

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
    ],
    "llama3_json": [
        (CALL, "", [("get_weather", {"city": "Paris"})]),
        (f"<|python_tag|>{CALL}; {CALL2}", "",
         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        (f"  \n{CALL2}", "", [("get_time", {"tz": "CET"})]),
        ("The weather is {fine}.", "The weather is {fine}.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        ("<|python", "<|python", []),  # cut off inside the tag: given back
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{CALL}, {CALL2}]", "",
         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        (f"Let me look.[TOOL_CALLS][{CALL}]", "Let me look.", [("get_weather", {"city": "Paris"})]),
        (f"[TOOL_CALLS] {CALL}", "", [("get_weather", {"city": "Paris"})]),
        ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
        ("[TOOL_CALLS] [{\"name\": ", "[TOOL_CALLS] [{\"name\": ", []),  # cut off: given back
        ("a [TOOL] b", "a [TOOL] b", []),
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
        for cut in range(len(output) + 1):
            text, calls, _ = run(name, [output[:cut], output[cut:]])
            assert (text, summary(calls)) == (content, expected), (output, cut)


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
