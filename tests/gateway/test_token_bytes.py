"""Logprobs' `bytes` are each token's own bytes (gateway/token_bytes.py): joined over a run
of tokens they decode to the text, emoji and CJK included; they were the UTF-8 of each
token's one-id decode, U+FFFD's EF BF BD for a token inside a character."""
from __future__ import annotations

from types import SimpleNamespace

from gateway.logprobs_output import chat_logprobs
from gateway.prompts import PromptBuilder
from gateway.token_bytes import token_bytes_reader
from tests.tiny_models import train_tokenizer

TEXT = "héllo wörld, naïve café, 日本語のテキスト, emoji 🚀🔥 <|im_end|>"


def test_byte_level_tokens_bytes_join_to_the_text():
    tok = train_tokenizer()
    prompts = PromptBuilder(tok, max_model_len=64)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(prompts.token_text(i) == "\ufffd" for i in ids)  # some split a character
    lps = [SimpleNamespace(token_id=i, logprob=-1.0, top=[]) for i in ids]
    content = chat_logprobs(lps, prompts.token_text)["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == TEXT
    assert "".join(e["token"] for e in content).count("\ufffd") > 0  # the text stays as was


def test_byte_fallback_and_plain_pieces():
    vocab = {0: "<0xF0>", 1: "▁Paris", 2: "<s>"}
    tok = SimpleNamespace(all_special_ids=[2], convert_ids_to_tokens=vocab.__getitem__)
    text = {0: "\ufffd", 1: " Paris", 2: "<s>"}.__getitem__
    read = token_bytes_reader(tok, text)  # no backend decoder: not byte-level
    assert (read(0), read(1), read(2)) == (b"\xf0", b" Paris", b"<s>")


def test_a_token_text_without_a_bytes_reader_keeps_utf8():
    lps = [SimpleNamespace(token_id=5, logprob=float("-inf"), top=[
        SimpleNamespace(token_id=6, logprob=-2.0)])]
    entry = chat_logprobs(lps, {5: "é", 6: "a"}.__getitem__)["content"][0]
    assert entry["bytes"] == [0xC3, 0xA9] and entry["top_logprobs"][0]["bytes"] == [97]
    assert entry["logprob"] == -9999.0
