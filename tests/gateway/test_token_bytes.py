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


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer built in-process: `▁` for spaces, `<0xNN>` byte fallback,
    the decoder strips the first space (so one id's decode of `▁` is "")."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "▁Paris", "▁is", "P", "a", "r", "i", "s", "é"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_sentencepiece_spaces_and_byte_fallback():
    """`▁` is a space (its one-id decode is ""), `<0xF0>` one byte: the run decodes to the
    text with SentencePiece's leading space."""
    tok = sentencepiece_tokenizer()
    text = "Paris is café 🚀"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode([ids[0]]) == "" and "<0xF0>" in tok.convert_ids_to_tokens(ids)
    read = token_bytes_reader(tok, lambda i: tok.decode([i]))
    assert b"".join(read(i) for i in ids).decode() == " " + text


def test_an_unreadable_tokenizer_falls_back_to_text_bytes():
    read = token_bytes_reader(SimpleNamespace(), {0: "é", 1: "\ufffd"}.__getitem__)
    assert (read(0), read(1)) == ("é".encode(), "\ufffd".encode())


def test_a_token_text_without_a_bytes_reader_keeps_utf8():
    lps = [SimpleNamespace(token_id=5, logprob=float("-inf"), top=[
        SimpleNamespace(token_id=6, logprob=-2.0)])]
    entry = chat_logprobs(lps, {5: "é", 6: "a"}.__getitem__)["content"][0]
    assert entry["bytes"] == [0xC3, 0xA9] and entry["top_logprobs"][0]["bytes"] == [97]
    assert entry["logprob"] == -9999.0
