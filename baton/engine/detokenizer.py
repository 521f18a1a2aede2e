"""Streams a request's output tokens as text, cut at stop strings.

Two stages per token, each O(window):

1. Incremental decoding (vLLM's prefix_offset / read_offset scheme). Only a short window of
   ids is decoded, never the whole output:

       window:  [ c c c | h h n ]     c: ids whose text was already emitted (context; at the
                          ^read          start, the prompt's last few ids), h: ids still held,
                                         n: the new id
       prefix_text = decode(window[:read])
       new_text    = decode(window)
       delta       = new_text[len(prefix_text):]      then window = window[read:]

   Decoding with a little context keeps tokenizers that strip or merge at the start of a
   decode (SentencePiece's leading space) right. If new_text ends in U+FFFD, a byte-level
   BPE token split a multi-byte character and the delta is held until the character
   completes (at most `_MAX_PENDING_TOKENS` tokens; past that the U+FFFD is real). A
   character still incomplete when the request ends (max_tokens cut it) is dropped, as vLLM's
   detokenizers drop it: the text never ends in a U+FFFD that only stands for missing bytes.

2. Stop strings. Text that could be the start of a stop string (the longest suffix that is a
   proper prefix of one, so at most len(longest stop) - 1 characters) is held back. A stop
   string is searched for only where it would end in the new text, so the held text plus the
   new text is all that is ever scanned. The first stop string to complete wins (as if the
   text were scanned character by character; at the same end, the longest).
"""
from __future__ import annotations

from typing import NamedTuple

from baton.engine.request import Request, RequestStatus
from baton.sampling_params import SamplingParams

# Prompt ids decoded as context before the first output token (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; this allows for a
# few undecodable special tokens in between before giving up holding text back.
_MAX_PENDING_TOKENS = 8


class DetokenizerUpdate(NamedTuple):
    """text_delta: new text to stream. stop_string: the stop string that ended the request."""

    text_delta: str
    stop_string: str | None


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas; see the module docstring.

    `output_text` is the decoded text so far (cut at a stop string); the deltas streamed so
    far are a prefix of it, and all of it once a stop string is found or `flush()` ran.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._max_stop_len = params.max_stop_len
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._window = context  # see the module docstring
        self._read = len(context)
        self.num_output_tokens = 0
        self._released: list[str] = []  # streamed deltas
        self._held = ""                  # decoded, not yet streamed (may start a stop string)
        self.stop_string: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        return "".join(self._released) + self._held

    def update(self, new_token_ids: list[int]) -> DetokenizerUpdate:
        """Add the newly sampled token ids; return the text that is now safe to stream."""
        if self.finished:
            raise RuntimeError("update() after the request finished (stop string or flush)")
        texts = [self._decode_next(t) for t in new_token_ids]
        before = self.num_output_tokens
        self.num_output_tokens += len(new_token_ids)
        # vLLM's min_tokens rule for stop strings: only one that ends in the text of an
        # output token past the first min_tokens stops the request
        shielded = min(max(0, self._min_tokens - before), len(texts))
        stop_from = len("".join(texts[:shielded])) if shielded < len(texts) else None
        return self._accept("".join(texts), stop_from)

    def flush(self) -> str:
        """End of the request (eos or length): return everything still held back.

        A character the last tokens left incomplete is dropped (module docstring); held
        bytes that were never going to complete within `_MAX_PENDING_TOKENS` would have been
        released already. A stop string completed by that last fragment still cuts the text.
        """
        if self.finished:
            return ""
        text = self._decode_window(force=True)
        delta, _ = self._accept(text, 0 if self.num_output_tokens > self._min_tokens else None)
        delta += self._held
        self._released.append(self._held)
        self._held = ""
        self.finished = True
        return delta

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        return self._decode_window(force=False)

    def _decode_window(self, force: bool) -> str:
        """Text of window[read:], or "" while it may still end inside a character."""
        if self._read == len(self._window):
            return ""
        prefix_text = self._decode(self._window[:self._read])
        new_text = self._decode(self._window)
        pending = len(self._window) - self._read
        incomplete = new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text)
        if incomplete and pending < _MAX_PENDING_TOKENS:
            if not force:
                return ""
            new_text = new_text.removesuffix("\ufffd")  # the end of the request cut it
        self._window = self._window[self._read:]  # the emitted ids become the next context
        self._read = len(self._window)
        return new_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _accept(self, text: str, stop_from: int | None) -> DetokenizerUpdate:
        """Append decoded `text` after the held text; cut at a stop string that ends at or
        after text[stop_from] (None: none may stop the request yet); hold a suffix."""
        candidate = self._held + text
        if stop_from is not None and text[stop_from:]:
            found = self._find_stop(candidate, len(self._held) + stop_from)
            if found is not None:
                stop, start = found
                end = start + len(stop) if self._include_stop else start
                self._held = ""
                self._released.append(candidate[:end])
                self.stop_string = stop
                self.finished = True
                return DetokenizerUpdate(candidate[:end], stop)
        keep = self._stop_prefix_len(candidate)
        delta = candidate[:len(candidate) - keep]
        self._held = candidate[len(candidate) - keep:]
        if delta:
            self._released.append(delta)
        return DetokenizerUpdate(delta, None)

    def _find_stop(self, text: str, new_from: int) -> tuple[str, int] | None:
        """(stop, start) of the first stop string to end at or after text[new_from]."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        return None if best is None else (best[2], best[0] - len(best[2]))

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            suffix = text[-k:]
            if any(stop.startswith(suffix) and len(stop) > k for stop in self._stops):
                return k
        return 0


def check_stop(req: Request, detok: IncrementalDetokenizer, token: int, max_model_len: int,
               grammar_complete: bool = False) -> tuple[RequestStatus | None, str]:
    """After `token` was appended to `req`: (the finished status it reaches, or None; the
    text it adds). Order: eos, then stop token ids (both only past min_tokens; their own
    text is added only with include_stop_str_in_output, as vLLM does), stop strings,
    then max_tokens / the context limit (FINISHED_LENGTH). Sets `req.stop_reason`.
    `grammar_complete`: its structured-output grammar allows nothing more, whatever
    min_tokens says: a normal stop, also on the last allowed token."""
    status, delta = _check_stop(req, detok, token, max_model_len)
    if grammar_complete and status in (None, RequestStatus.FINISHED_LENGTH):
        delta += detok.flush() if status is None else ""
        status = RequestStatus.FINISHED_STOPPED
    return status, delta


def _check_stop(req: Request, detok: IncrementalDetokenizer, token: int,
                max_model_len: int) -> tuple[RequestStatus | None, str]:
    params = req.sampling_params
    n_out = len(req.output_token_ids)
    may_stop = n_out >= params.min_tokens
    eos = token in req.eos_token_ids
    if may_stop and (eos or token in params.stop_token_ids):
        if not eos:  # eos first: its stop_reason stays None (vLLM's order)
            req.stop_reason = token
        # its text ends the output only with include_stop_str_in_output (vLLM's rule, eos
        # too: "<|im_end|>" with skip_special_tokens false, else nothing)
        text = detok.update([token]).text_delta if params.include_stop_str_in_output else ""
        return RequestStatus.FINISHED_STOPPED, text + detok.flush()
    update = detok.update([token])
    if update.stop_string is not None:
        req.stop_reason = update.stop_string
        return RequestStatus.FINISHED_STOPPED, update.text_delta
    if n_out >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, update.text_delta + detok.flush()
    return None, update.text_delta
