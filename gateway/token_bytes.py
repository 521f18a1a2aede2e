"""The raw bytes of one token, for OpenAI's logprobs `bytes` field.

A token can hold part of a character (an emoji or a CJK character is often two to four
tokens): decoding that one id gives U+FFFD, whose bytes (EF BF BD) say nothing. OpenAI
documents `bytes` so that clients can join a run of tokens' bytes and decode the character;
vLLM sends the token's own bytes. They come from xgrammar's `TokenizerInfo.decoded_vocab`
(already a dependency: the decode workers' grammar engine builds the same table), which reads
every kind of vocabulary the served models use: byte-level BPE (GPT-2's byte-to-character
table, SmolLM2's and Llama 3's tokenizers), SentencePiece with byte fallback (`▁` is a space,
`<0xE2>` one byte) and tiktoken. An id past that table, an entry it leaves empty, or a
tokenizer xgrammar cannot read falls back to the UTF-8 of the token's decoded text.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def token_bytes_reader(tokenizer, token_text: Callable[[int], str]) -> Callable[[int], bytes]:
    """A function token id -> the token's bytes (see the module docstring). `tokenizer`: a
    Hugging Face tokenizer; `token_text`: its one-id decode, the fallback. The table is built
    on the first call (SmolLM2's 49,152 tokens: ~0.2 s), not at start."""
    table: list[bytes] | None = None

    def token_bytes(token_id: int) -> bytes:
        nonlocal table
        if table is None:
            table = _decoded_vocab(tokenizer)
        raw = table[token_id] if 0 <= token_id < len(table) else b""
        return raw or token_text(token_id).encode()

    return token_bytes


def _decoded_vocab(tokenizer) -> list[bytes]:
    try:
        import xgrammar as xgr

        return list(xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab)
    except Exception as e:  # noqa: BLE001 - any tokenizer xgrammar cannot read: text bytes
        log.warning("logprobs bytes: xgrammar cannot read this tokenizer (%s); each token's "
                    "bytes are its decoded text's", e)
        return []
