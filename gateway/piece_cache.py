"""Tokenization that reuses work across an agent session's turns.

Every turn's prompt repeats the whole history, and tokenizing is the gateway's biggest cost
(about 4 µs a token on the reference CPU: 120 ms for a 30k-token context). Hugging Face
tokenizers first split the text at added tokens (<|im_start|>, <|im_end|>, ...) and tokenize
each stretch between them on its own, so those stretches ("pieces") can be cached and a new
turn costs only its new text:

    <|im_start|>user\\nWeather in Paris?<|im_end|>\\n<|im_start|>assistant\\n ...
    └─ added ──┘└────── piece ──────┘└─ added ─┘└┘└─ added ──┘└── piece ─...

That is exact only when the split is all there is: no added token strips its neighbours
(lstrip / rstrip / single_word), none is matched after normalization, and the pre-tokenizer
does not treat the start of the text specially (SentencePiece's "prepend ▁ to the first
piece"). A self-check at start-up compares piecewise and whole encodings on probe strings;
any difference turns the cache off and every call is a plain `encode`.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict

logger = logging.getLogger(__name__)

_PROBE_TEXTS = ("Hello world", " leading space", "trailing space ", "\n\nnew\nlines\n",
                "héllo wörld 日本語 🚀", "digits 12345 and code: def f(x): return x",
                "  two  spaces  ", "{\"name\": \"f\", \"arguments\": {}}")


class PieceTokenizer:
    """encode(text) == tokenizer.encode(text, add_special_tokens=...), with a piece cache when
    the self-check passes. max_chars bounds the cached text (the ids take about as much)."""

    def __init__(self, tokenizer, max_chars: int = 32 << 20) -> None:
        self._tok = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
        self._added_ids = added
        self._split = re.compile("(" + "|".join(
            re.escape(s) for s in sorted(added, key=len, reverse=True)) + ")") if added else None
        self._bos = list(tokenizer.encode("", add_special_tokens=True))
        self.enabled = self._split is not None and self._backend is not None \
            and self._simple_added_tokens() and self._self_check()
        if not self.enabled:
            logger.info("piecewise tokenization off for this tokenizer (plain encode)")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`, as `tokenizer.encode(text, add_special_tokens=...)` gives them."""
        if not self.enabled:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        ids = list(self._bos) if add_special_tokens else []
        self.encode_into(text, 0, ids)
        return ids

    def encode_into(self, text: str, start: int, ids: list[int],
                    marks: list[tuple[int, int]] | None = None) -> None:
        """Append the ids of text[start:] to `ids` (the cache must be enabled; `start` must be
        0 or where an added token starts in `text`). marks: when given, (char position, index
        in `ids`) of every added token is appended to it."""
        pos = start
        for m in self._split.finditer(text, start):
            if m.start() > pos:
                ids += self._piece(text[pos:m.start()])
            if marks is not None:
                marks.append((m.start(), len(ids)))
            ids.append(self._added_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._piece(text[pos:])

    def added_at(self, text: str, pos: int) -> int | None:
        """The id of the added token starting at text[pos] (None: none starts there)."""
        m = self._split.match(text, pos) if self._split is not None else None
        return None if m is None else self._added_ids[m.group()]

    @property
    def longest_added(self) -> int:
        """Characters in the longest added token (0 without any)."""
        return max(map(len, self._added_ids), default=0)

    def _piece(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is not None:
            self._cache.move_to_end(text)
            return ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if len(text) <= self._max_chars // 4:
            self._cache[text] = ids
            self._chars += len(text)
            while self._chars > self._max_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
        return ids

    def _simple_added_tokens(self) -> bool:
        has_normalizer = self._backend.normalizer is not None
        return all(not (t.lstrip or t.rstrip or t.single_word or (t.normalized and has_normalizer))
                   for t in self._tok.added_tokens_decoder.values())

    def _self_check(self) -> bool:
        specials = list(self._added_ids)[:4]
        probes = list(_PROBE_TEXTS)
        for s in specials:
            probes += [f"{s}user\n{_PROBE_TEXTS[0]}{s}\n{s}assistant\n",
                       f" {s} x{s}{s}y {s}", f"{_PROBE_TEXTS[4]}{s}{_PROBE_TEXTS[6]}"]
        self.enabled = True
        try:
            for text in probes:
                for special in (False, True):
                    if self.encode(text, special) != list(self._tok.encode(
                            text, add_special_tokens=special)):
                        return False
            return True
        finally:
            self._cache.clear()
            self._chars = 0
