"""Structured outputs: grammar-constrained decoding with xgrammar.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models", 2024; https://github.com/mlc-ai/xgrammar, the default backend of vLLM
and SGLang) compiles a JSON Schema into a pushdown automaton over the tokenizer's vocabulary;
a per-request matcher then fills a bitmask of the tokens allowed next ([ceil(V / 32)] int32,
bit t of word t // 32 set = token t allowed) and advances by each accepted token. Chosen
over llguidance and outlines-core for its per-step cost on CPU (benchmarks/grammar_libs.py;
README "Structured outputs").

    spec (SamplingParams.structured_output)
      │  GrammarCompiler.matcher(spec): compile once per distinct spec (LRU), fresh matcher
      ▼
    Request.grammar: GrammarMatcher ──► Sampler: apply_grammar_masks (constrained rows only,
      ▲                                 after logit bias / penalties, before temperature)
      └── LLMEngine.accept_token: advance(token) → True when the grammar is complete and
          nothing but EOS may follow: the request ends ("stop") without sampling the EOS.

EOS (the tokenizer info's stop tokens = the engine's eos ids) is allowed only where the
grammar may end. Whitespace between JSON tokens is fixed (`any_whitespace=False`): small
models otherwise fill the output with newlines.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

try:
    import xgrammar as xgr
except ImportError:  # an image without it (the GPU check machine): the engine runs, and
    xgr = None       # a structured-output request is refused with a ValueError

from baton.json_schema import (
    STRUCTURED_OUTPUT_FIELD,
    FieldError,
    grammar_from_json_schema,
    short_error,
)
from baton.sampling_params import StructuredOutput, StructuredOutputKind

_ANY_OBJECT = json.dumps({"type": "object"})
_MISSING = "structured output needs the xgrammar package, which is not installed here"


def build_grammar(spec: StructuredOutput) -> xgr.Grammar:
    """The spec's grammar: prefix, the JSON value, suffix (no tokenizer needed). ValueError: a
    schema xgrammar cannot convert."""
    if xgr is None:
        raise ValueError(_MISSING)
    schema = spec.json_schema if spec.kind == StructuredOutputKind.JSON_SCHEMA else _ANY_OBJECT
    parts = [grammar_from_json_schema(schema)]
    if spec.prefix:
        parts.insert(0, _literal(spec.prefix))
    if spec.suffix:
        parts.append(_literal(spec.suffix))
    return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)


def _literal(text: str) -> xgr.Grammar:
    # A JSON string literal is also a valid EBNF string literal in xgrammar's syntax.
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


class GrammarCompiler:
    """Compiles specs for one tokenizer; the last `cache_size` distinct specs stay compiled.

    The tokenizer's vocabulary is read on the first compile (about 0.4 s for a 49k vocabulary),
    so an engine that is never asked for structured output pays nothing.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = 32) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (cached). ValueError: the schema does not compile."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        if xgr is None:
            raise ValueError(_MISSING)
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            # One thread: workers share their cores with the model; the cache is ours.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            compiled = self._compiler.compile_grammar(build_grammar(spec))
        except RuntimeError as e:
            raise ValueError(f"structured output does not compile: {short_error(e)}") from e
        self._cache[spec] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request. FieldError (a ValueError naming the
        structured output): the schema does not compile."""
        try:
            compiled = self.compile(spec)
        except ValueError as e:
            raise FieldError(str(e), STRUCTURED_OUTPUT_FIELD) from e
        return GrammarMatcher(compiled, self.stop_token_ids, self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar (engine thread only)."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int],
                 vocab_size: int) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._stop = torch.tensor(list(stop_token_ids), dtype=torch.int64)
        self._vocab_size = vocab_size

    def fill_mask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] ([B, ceil(V / 32)] int32, CPU)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def advance(self, token: int) -> bool:
        """Accept the sampled `token`; True when the output is complete (EOS accepted, or the
        grammar complete with only EOS allowed next). ValueError: the grammar forbids it."""
        if not self._m.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the request's grammar")
        if self._m.is_terminated():
            return True
        return self._m.is_completed() and self._only_stop_allowed()

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (drafted tokens) the grammar accepts in order from here,
        stopping before one that would end the output (ending it is left to the model). The
        matcher is left as it was (xgrammar's rollback)."""
        n = 0
        for t in token_ids:
            if not self._m.accept_token(t):
                break
            n += 1
            if self._m.is_terminated() or self._m.is_completed():
                self._m.rollback(1)
                n -= 1
                break
        if n:
            self._m.rollback(n)
        return n

    def fill_masks_along(self, token_ids: Sequence[int], bitmask: Tensor, first_row: int) -> None:
        """bitmask[first_row + j] = the tokens allowed after token_ids[:j], j = 0 .. len
        (token_ids: a `valid_prefix`); the matcher is left as it was."""
        for j, t in enumerate(token_ids):
            self._m.fill_next_token_bitmask(bitmask, first_row + j)
            if not self._m.accept_token(t):
                if j:
                    self._m.rollback(j)
                raise ValueError(f"drafted token {t} is not allowed by the request's grammar")
        self._m.fill_next_token_bitmask(bitmask, first_row + len(token_ids))
        if token_ids:
            self._m.rollback(len(token_ids))

    def _only_stop_allowed(self) -> bool:
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._m.fill_next_token_bitmask(mask, 0)
        allowed = unpack_bitmask(mask, self._vocab_size)[0]
        allowed[self._stop] = False
        return not bool(allowed.any())


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[B, ceil(V / 32)] int32 → [B, V] bool: token t allowed iff bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]; arithmetic shift keeps bit 0 right
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_grammar_masks(logits: Tensor, grammars: Sequence[GrammarMatcher | None] | None,
                        owned: bool) -> Tensor:
    """Set each constrained row's forbidden logits to -inf; other rows stay bit-identical.

    logits: [B, V] float32; grammars: length B (None = unconstrained row), or None for a
    batch without any. owned: `logits` may be written in place (else a copy is made, and
    only when some row is constrained). The mask is applied in torch (`unpack_bitmask`):
    on CPU it is several times faster than xgrammar's own `apply_token_bitmask_inplace`
    (benchmarks/grammar_libs.py --sampler) and it runs unchanged on an accelerator.
    """
    rows = [i for i, g in enumerate(grammars or ()) if g is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])  # [R, ceil(V / 32)]
    for j, i in enumerate(rows):
        grammars[i].fill_mask(bitmask, j)
    out = logits if owned else logits.clone()
    index = torch.tensor(rows, device=logits.device)
    forbidden = ~unpack_bitmask(bitmask.to(logits.device), logits.shape[1])  # [R, V]
    out[index] = out[index].masked_fill_(forbidden, float("-inf"))
    return out


class _RowMask:
    """One precomputed mask row standing in for a matcher in `apply_grammar_masks`."""

    def __init__(self, masks: Tensor, row: int) -> None:
        self._masks, self._row = masks, row

    def fill_mask(self, bitmask: Tensor, row: int) -> None:
        bitmask[row].copy_(self._masks[self._row])


def masks_along(matcher: GrammarMatcher, token_ids: Sequence[int],
                vocab_size: int) -> list[_RowMask]:
    """Stand-ins for `matcher` at each position of a speculative row (spec/verify.py): the
    mask after j of `token_ids` (a `valid_prefix`) are accepted, j = 0 .. len(token_ids)."""
    masks = xgr.allocate_token_bitmask(len(token_ids) + 1, vocab_size)
    matcher.fill_masks_along(token_ids, masks, 0)
    return [_RowMask(masks, j) for j in range(len(token_ids) + 1)]
