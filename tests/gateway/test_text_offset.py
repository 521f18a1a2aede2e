"""Completions' legacy `text_offset` counts characters of the text, also where byte-level
tokens split a character (each such token's text is U+FFFD; its bytes are the real ones)."""
from types import SimpleNamespace

from gateway.logprobs_output import TextOffsets, completion_logprobs

# "I 🐦 you're" as byte-level tokens: the bird's 4 bytes come in three tokens
PIECES = [b"I", b" \xf0", b"\x9f\x90", b"\xa6", b" you", b"'re"]


def _token_text():
    def text(i: int) -> str:
        return PIECES[i].decode("utf-8", errors="replace")
    text.bytes = lambda i: PIECES[i]
    return text


def _lps(ids):
    return [SimpleNamespace(token_id=i, logprob=-0.5, top=[]) for i in ids]


def test_offsets_name_the_characters_each_token_starts_at():
    full = b"".join(PIECES).decode()
    assert full == "I 🐦 you're"
    lp = completion_logprobs(_lps(range(1, 6)), _token_text(), head=0)
    assert lp["tokens"][1:4] == [" \ufffd", "\ufffd\ufffd", "\ufffd"]
    assert lp["text_offset"] == [0, 1, 2, 2, 3, 7]  # one count per token's own text ran on
    assert full[lp["text_offset"][4]:].startswith(" you")
    assert full[lp["text_offset"][5]:] == "'re"


def test_a_stream_keeps_counting_across_chunks():
    """A character split between two chunks is counted once, in the chunk that ends it."""
    offsets, text = TextOffsets(), _token_text()
    got = []
    for ids in ([0, 1], [2], [3, 4], [5]):
        got += completion_logprobs(_lps(ids), text, offsets)["text_offset"]
    assert got == [0, 1, 2, 2, 3, 7]
