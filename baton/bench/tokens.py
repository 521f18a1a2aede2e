"""Token counts for prompts, and token synthesis for block-hash traces.

`TokenCounter` counts with the served model's tokenizer (`AutoTokenizer` on the folder that
`baton.models.registry.resolve_model` returns) or, when there is none, approximately: one
"token" per 4 characters. Chat prompts are rendered as the gateway renders them by default
(baton/chat_format.py: the tokenizer's chat template, or the shipped tool-aware one that
replaces it, e.g. SmolLM2's; messages normalized; `tools` passed to the template; ChatML
without a template) and tokenized per message, so the token list of turn k is literally the
token list of turn k-1 plus the new messages (exact for templates that start each message
with a special token, such as ChatML; a close estimate otherwise).

`BlockSynth` turns hash ids into tokens: every (namespace, hash id) maps deterministically to
`block_tokens` words drawn from a fixed list, so requests with equal leading ids share real
token prefixes and different ids do not (beyond chance agreement of a first word).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from baton.chat_format import message_text, normalize_message, resolve_chat_template

logger = logging.getLogger(__name__)

# Fallback words (no tokenizer): short common words, mostly one BPE token each after a space.
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some can out other were all there when up use your how said each she which "
    "their time will way about many then them write would like so these her long make thing see "
    "him two has look more day could come did number sound most people over know water than call "
    "first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good give our under name very through just "
    "form great think say help low line turn cause much mean before move right boy old too same"
).split()


def _piece_ids(text: str) -> list[int]:
    """The chars/4 approximation: one pseudo-token per 4-character piece."""
    return [zlib.crc32(text[i:i + 4].encode()) for i in range(0, len(text), 4)]


class TokenCounter:
    """Counts tokens of text and chat prompts; `approximate` when no tokenizer was loaded.
    chat_template: the template text to render with (None: the tokenizer's own)."""

    def __init__(self, tokenizer=None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def for_model(cls, model: str | None) -> TokenCounter:
        """The served model's tokenizer, or the chars/4 estimate when it cannot be loaded."""
        if not model:
            return cls(None)
        try:
            from transformers import AutoTokenizer

            from baton.models.registry import resolve_model

            folder = Path(model) if Path(model).is_dir() else resolve_model(model)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            return cls(tokenizer, resolve_chat_template(None, tokenizer.chat_template))
        except Exception as exc:  # noqa: BLE001 - any failure means "estimate instead"
            logger.warning("no tokenizer for %s (%s): counting chars/4", model, exc)
            return cls(None)

    @property
    def approximate(self) -> bool:
        return self.tokenizer is None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return _piece_ids(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def _render(self, messages: list[dict], generation: bool,
                tools: list[dict] | None = None) -> str:
        tok = self.tokenizer
        if tok is not None and (self.chat_template or getattr(tok, "chat_template", None)):
            return tok.apply_chat_template([normalize_message(m) for m in messages],
                                           tools=tools or None, tokenize=False,
                                           chat_template=self.chat_template,
                                           add_generation_prompt=generation)
        text = "".join(f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}"
                       f"{_calls_text(m.get('tool_calls'))}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if generation else "")

    def chat_prompts(self, messages: list[dict], ends: list[int],
                     tools: list[dict] | None = None) -> list[np.ndarray]:
        """Token ids of each prompt `messages[:end] + generation prompt` (with `tools`), for
        end in `ends`.

        Renders every message prefix once and tokenizes only the new piece of text; falls back
        to tokenizing each whole prompt if the template is not prefix-additive.
        """
        n = max(ends)
        renders = [self._render(messages[:e], False, tools) for e in range(1, n + 1)]
        pieces, prev = [], ""
        for r in renders:
            if not r.startswith(prev):
                return [np.asarray(self.encode(self._render(messages[:e], True, tools)),
                                   np.int64) for e in ends]
            pieces.append(np.asarray(self.encode(r[len(prev):]), np.int64))
            prev = r
        out = []
        for e in ends:
            full = self._render(messages[:e], True, tools)
            base = renders[e - 1]
            if not full.startswith(base):
                out.append(np.asarray(self.encode(full), np.int64))
                continue
            out.append(np.concatenate(pieces[:e] + [np.asarray(self.encode(full[len(base):]),
                                                               np.int64)]))
        return out


def _calls_text(calls) -> str:
    """Tool calls as text, for the approximate count without a template."""
    return "".join(json.dumps(c.get("function", c)) for c in calls or ())


def _vocab_words(tokenizer) -> tuple[list[int], list[str]]:
    """Single-token words " abc" of the tokenizer (lowest ids first), or the fallback list."""
    if tokenizer is None:
        return [], [" " + w for w in _WORDS]
    pattern = re.compile(r"^(Ġ|▁)([a-z]{3,8})$")
    found = []
    for token, idx in tokenizer.get_vocab().items():
        m = pattern.match(token)
        if m:
            found.append((idx, " " + m.group(2)))
    found.sort()
    found = found[:4096]
    if len(found) < 64:
        return [], [" " + w for w in _WORDS]
    return [i for i, _ in found], [w for _, w in found]


class BlockSynth:
    """Deterministic tokens for block hash ids.

    ids_for(ns, hash_ids, n) -> token ids (tokenizer vocabulary), text_for(...) -> text. The
    namespace separates sessions whose ids are local (AgentX) and runs (the cache salt).
    """

    def __init__(self, tokenizer, block_tokens: int):
        self.block_tokens = block_tokens
        self.token_ids, self.words = _vocab_words(tokenizer)
        self._block = lru_cache(maxsize=1 << 16)(self._make_block)

    @property
    def has_token_ids(self) -> bool:
        return bool(self.token_ids)

    def _make_block(self, ns: str, hash_id: int) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(f"{ns}/{hash_id}".encode(), digest_size=8).digest(),
                              "little")
        rng = np.random.default_rng(seed)
        return rng.integers(0, len(self.words), self.block_tokens)

    def word_indices(self, ns: str, hash_ids: tuple[int, ...], num_tokens: int) -> np.ndarray:
        """Indices into the word list: the blocks of `hash_ids`, cut to `num_tokens`."""
        if not hash_ids:
            return np.zeros(0, np.int64)
        blocks = np.concatenate([self._block(ns, h) for h in hash_ids])
        return blocks[:num_tokens]

    def ids_for(self, ns: str, hash_ids: tuple[int, ...], num_tokens: int) -> list[int]:
        table = np.asarray(self.token_ids, np.int64)
        return table[self.word_indices(ns, hash_ids, num_tokens)].tolist()

    def text_for(self, ns: str, hash_ids: tuple[int, ...], num_tokens: int) -> str:
        return "".join(self.words[i] for i in self.word_indices(ns, hash_ids, num_tokens))
