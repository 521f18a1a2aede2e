"""Which grammar library is cheapest per decode step on this CPU: xgrammar, llguidance,
outlines-core (the libraries vLLM and SGLang use for structured outputs).

For each library and grammar (a typical JSON schema, and "any JSON object"): compile time
(tokenizer setup excluded, measured once: it is per process) and, walking the tokens of a
valid answer, the time of one step's mask (fill the [1, ceil(V/32)] int32 bitmask) plus
advancing the matcher by one token. Single-threaded, as a worker's engine thread runs it.

    python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch==2.13.0 xgrammar \
        llguidance outlines-core transformers==5.24.0
    PYTHONPATH=. /tmp/gvenv/bin/python benchmarks/grammar_libs.py \
        --tokenizer ~/.cache/baton/models/smollm2-135m
    PYTHONPATH=. python benchmarks/grammar_libs.py --sampler   # Baton's Sampler, xgrammar

`--sampler` times one `Sampler` call on a batch of 8 rows (greedy, V = the vocabulary) with
0, 1 and 8 rows under the schema: the whole per-step cost of structured outputs in Baton.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
          "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}}


class XGrammar:
    def __init__(self, tok, vocab):
        import xgrammar as xgr
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab), max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return (self.compiler.compile_json_schema(json.dumps(schema)) if schema
                else self.compiler.compile_builtin_json_grammar())

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m, token):
        m.fill_next_token_bitmask(self.mask, 0)
        assert m.accept_token(token)


class LLGuidance:
    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema or {"type": "object"}))
        return self.llg.LLMatcher(self.tok, grammar)  # lazy: built on the first masks

    def matcher(self, compiled):
        return compiled.deep_copy()

    def step(self, m, token):
        self.llg.torch.fill_next_token_bitmask(m, self.mask, 0)
        assert m.consume_token(token), m.get_error()


class OutlinesCore:
    def __init__(self, tok, vocab):
        from outlines_core import Vocabulary
        from outlines_core.kernels.torch import allocate_token_bitmask
        decoder = _byte_decoder()
        words: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i != tok.eos_token_id and text not in tok.all_special_tokens:
                words.setdefault(bytes(decoder[c] for c in text), []).append(i)
        self.vocab = Vocabulary(tok.eos_token_id, words)
        self.mask = allocate_token_bitmask(vocab)

    def compile(self, schema):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema
        return Index(build_regex_from_schema(json.dumps(schema or {"type": "object"})),
                     self.vocab)

    def matcher(self, compiled):
        from outlines_core import Guide
        return Guide(compiled)

    def step(self, m, token):
        from outlines_core.kernels.torch import fill_next_token_bitmask
        fill_next_token_bitmask(m, self.mask)
        m.advance(token)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted (byte-level BPE token text → bytes)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def measure(lib, schema, tokens, repeats):
    t0 = time.perf_counter()
    compiled = lib.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    steps = []
    for _ in range(repeats):
        m = lib.matcher(compiled)
        for t in tokens:
            s = time.perf_counter()
            lib.step(m, t)
            steps.append((time.perf_counter() - s) * 1e6)
    first = steps[0]
    return compile_ms, first, statistics.median(steps), statistics.mean(steps), max(steps)


def sampler_cost(tok, vocab: int, steps: int = 50) -> None:
    from baton.engine.grammar import GrammarCompiler
    from baton.engine.sampler import Sampler
    from baton.sampling_params import SamplingParams, StructuredOutput, StructuredOutputKind
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    spec = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
    tokens = tok.encode(json.dumps(ANSWER, separators=(", ", ": ")), add_special_tokens=False)
    sampler, params = Sampler(), [SamplingParams(temperature=0.0)] * 8
    print(f"Sampler, 8 greedy rows, V={vocab}: median us per step")
    for constrained in (0, 1, 8):
        times = []
        for _ in range(3):
            ms = [compiler.matcher(spec) for _ in range(constrained)]
            for t in tokens[:steps]:
                logits = torch.randn(8, vocab)
                grammars = ms + [None] * (8 - constrained) if ms else None
                s = time.perf_counter()
                sampler(logits, params, [None] * 8, grammars=grammars)
                times.append((time.perf_counter() - s) * 1e6)
                for m in ms:
                    m.advance(t)
        print(f"  {constrained} constrained: {statistics.median(times):8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache/baton/models/smollm2-135m"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    ap.add_argument("--sampler", action="store_true", help="time Baton's Sampler instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok)
    if args.sampler:
        return sampler_cost(tok, vocab)
    tokens = tok.encode(json.dumps(ANSWER), add_special_tokens=False)
    libs = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}
    print(f"vocab {vocab}, answer {len(tokens)} tokens, {args.repeats} walks")
    print(f"{'library':14} {'grammar':11} {'setup ms':>9} {'compile ms':>11} {'1st step us':>12}"
          f" {'p50 us':>8} {'mean us':>8} {'max us':>8}")
    for name in args.libs.split(","):
        t0 = time.perf_counter()
        lib = libs[name](tok, vocab)
        setup = (time.perf_counter() - t0) * 1e3
        for label, schema in (("json_schema", SCHEMA), ("json_object", None)):
            c, first, p50, mean, mx = measure(lib, schema, tokens, args.repeats)
            print(f"{name:14} {label:11} {setup:9.1f} {c:11.1f} {first:12.1f} {p50:8.1f}"
                  f" {mean:8.1f} {mx:8.1f}")


if __name__ == "__main__":
    main()
