"""The raw UTF-8 bytes of one token, for OpenAI's logprobs `bytes` field.

A token can hold part of a character (an emoji or a CJK character is often two or three
byte-level tokens): decoding that one id gives U+FFFD, whose bytes (EF BF BD) say nothing.
OpenAI documents `bytes` so that clients can join a run of tokens' bytes and decode the
character; vLLM sends the token's own bytes. They are read from the token's vocabulary
string:

- byte-level BPE (GPT-2's scheme, SmolLM2's and Llama 3's tokenizers): each character of the
  string stands for one byte through GPT-2's `bytes_to_unicode` table (openai/gpt-2,
  src/encoder.py), inverted here;
- SentencePiece byte fallback: a token `<0xE2>` is that one byte;
- anything else (a whole-character piece, a special token): the UTF-8 of its decoded text,
  as before.
"""
from __future__ import annotations

import re
from collections.abc import Callable

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _unicode_to_bytes() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable latin-1 bytes map to themselves, the
    other 68 to U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes_reader(tokenizer, token_text: Callable[[int], str]) -> Callable[[int], bytes]:
    """A function token id -> the token's bytes (see the module docstring). `tokenizer`: a
    Hugging Face tokenizer; `token_text`: its one-id decode, the fallback."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    to_byte = _unicode_to_bytes()
    special = set(getattr(tokenizer, "all_special_ids", ()))

    def token_bytes(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id) if token_id not in special else None
        if isinstance(piece, str):
            if byte_level and piece and all(c in to_byte for c in piece):
                return bytes(to_byte[c] for c in piece)
            if m := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
        return token_text(token_id).encode()

    return token_bytes
