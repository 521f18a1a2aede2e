"""Logprobs in the OpenAI shapes, from the decode worker's TokenLogprobs messages.

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}
                 (`bytes`: the token's own bytes, gateway/token_bytes.py)
    completions  {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (the legacy
                 shape): each top_logprobs entry holds the chosen token and the k most
                 likely ones (up to k + 1 keys, OpenAI's rule and vLLM's); with `echo` the
                 prompt's tokens come first, the first of them with null logprob and top
    prompt_logprobs  vLLM's extension: [null, {"<token id>": {"logprob", "rank",
                 "decoded_token"}, ...}, ...], one entry per prompt token, each with the
                 prompt token and its top k

A logprob of -inf is written -9999.0 (JSON has no infinity; vLLM's value). With vLLM's
`return_tokens_as_token_ids` the logprobs name each token "token_id:N" (`token_id_text`):
chat's `token` and its top_logprobs', completions' `tokens` and top_logprobs keys; `bytes`,
`text_offset` and prompt_logprobs' `decoded_token` stay the token's own, as vLLM's do.
"""
from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

TokenText = Callable[[int], str]
NEG_INF = -9999.0


def token_id_text(token_text: TokenText) -> TokenText:
    """A TokenText naming each token "token_id:N" (vLLM's return_tokens_as_token_ids, so a
    client maps logprobs back to ids without the tokenizer, whatever the token's bytes),
    with `bytes` (the token's own, `_raw` of `token_text`) and `text` (its own decode)."""
    def by_id(token_id: int) -> str:
        return f"token_id:{token_id}"
    by_id.bytes = lambda t: _raw(token_text, t)
    by_id.text = token_text
    return by_id


def _text(token_text: TokenText) -> TokenText:
    """The token's own text (not its id name) for `decoded_token`."""
    return getattr(token_text, "text", token_text)


def _finite(x: float) -> float:
    return max(x, NEG_INF)


def chat_logprobs(lps: Sequence, token_text: TokenText) -> dict:
    """Chat's `logprobs` of some output tokens (TokenLogprobs messages)."""
    return {"content": [_chat_entry(lp, token_text) for lp in lps]}


def _raw(token_text: TokenText, token_id: int) -> bytes:
    """The token's raw bytes where token_text carries a `bytes` reader (PromptBuilder's:
    gateway/token_bytes.py; a token inside a character decodes to U+FFFD, its bytes do
    not), else the UTF-8 of its text."""
    raw = getattr(token_text, "bytes", None)
    return raw(token_id) if raw is not None else token_text(token_id).encode()


def _bytes(token_text: TokenText, token_id: int) -> list[int]:
    """`_raw` as the JSON list of byte values chat's `bytes` field is."""
    return list(_raw(token_text, token_id))


def _chat_entry(lp, token_text: TokenText) -> dict:
    return {"token": token_text(lp.token_id), "logprob": _finite(lp.logprob),
            "bytes": _bytes(token_text, lp.token_id),
            "top_logprobs": [{"token": token_text(x.token_id), "logprob": _finite(x.logprob),
                              "bytes": _bytes(token_text, x.token_id)} for x in lp.top]}


class TextOffsets:
    """Where each token of one choice starts in its text (the legacy `text_offset`), in
    characters: the UTF-8 decode of the tokens' bytes so far, a character counted once it
    is complete, as the streamed text counts it. Counting each token's own text instead
    counted a token inside a character as one character (its U+FFFD), so a non-ASCII text's
    later offsets ran past the characters they name. Keep one per choice across a stream's
    chunks (a character can span two chunks)."""

    def __init__(self) -> None:
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, raw: bytes) -> int:
        """The offset of the token whose bytes are `raw`; counts them for the next one."""
        at = self.offset
        self.offset += len(self._utf8.decode(raw))
        return at


def completion_logprobs(lps: Sequence, token_text: TokenText,
                        offsets: TextOffsets | None = None, head: int | None = None) -> dict:
    """Completions' legacy `logprobs` of some tokens (TokenLogprobs messages); text offsets
    from `offsets` (TextOffsets; a new one from 0 when None). head: an echoed prompt's
    first token id, which has no logprob (its entry comes first, with nulls)."""
    offsets = TextOffsets() if offsets is None else offsets
    tokens, token_logprobs, tops, text_offset = [], [], [], []
    ids = ([head] if head is not None else []) + [lp.token_id for lp in lps]
    if head is not None:
        tokens.append(token_text(head))
        token_logprobs.append(None)
        tops.append(None)
    for lp in lps:
        tokens.append(token_text(lp.token_id))
        token_logprobs.append(_finite(lp.logprob))
        top = {tokens[-1]: token_logprobs[-1]}
        top.update((token_text(t.token_id), _finite(t.logprob)) for t in lp.top)
        tops.append(top)
    for token_id in ids:
        text_offset.append(offsets.next(_raw(token_text, token_id)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": text_offset}


def prompt_logprobs_field(lps: Sequence, token_text: TokenText) -> list:
    """vLLM's `prompt_logprobs` of a prompt whose tokens after the first are `lps`."""
    out: list = [None]
    text = _text(token_text)
    for lp in lps:
        entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank or None,
                                    "decoded_token": text(lp.token_id)}}
        for rank, t in enumerate(lp.top, start=1):
            entry.setdefault(str(t.token_id), {"logprob": _finite(t.logprob), "rank": rank,
                                               "decoded_token": text(t.token_id)})
        out.append(entry)
    return out
