"""Grammar-constrained sampling (baton/engine/grammar.py) with the tiny BPE tokenizer: masked
rows emit only grammar-valid tokens, unconstrained rows are bit-identical, specs compile once."""
import json

import jsonschema
import pytest
import torch

from baton.engine.grammar import GrammarCompiler, apply_grammar_masks, unpack_bitmask
from baton.engine.sampler import Sampler, make_generator
from baton.sampling_params import SamplingParams, StructuredOutput, StructuredOutputKind
from baton.worker.wire import sampling_params_from_proto, sampling_params_to_proto
from gateway.tool_calls import parse_calls
from tests.tiny_models import train_tokenizer

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["city", "n", "ok"], "additionalProperties": False}
SPEC = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
VOCAB = 400  # above the tokenizer's 384, as models pad their vocabularies


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [tok.eos_token_id])


def _walk(compiler, spec, params, seed, steps=400):
    """Sample a constrained row beside an unconstrained one on random logits. Returns (the
    constrained row's tokens, the unconstrained row's tokens with and without the grammar
    row's mask in the batch)."""
    g = torch.Generator().manual_seed(seed)
    matcher = compiler.matcher(spec)
    sampler = Sampler()
    gens = [make_generator(seed) if params.seed is not None else None for _ in range(2)]
    plain_gens = [make_generator(seed) if params.seed is not None else None for _ in range(2)]
    ours, free, alone = [], [], []
    for _ in range(steps):
        logits = torch.randn(2, VOCAB, generator=g) * 3
        out = sampler(logits, [params, params], gens, grammars=[matcher, None])
        ref = sampler(logits, [params, params], plain_gens)
        ours.append(int(out.token_ids[0]))
        free.append(int(out.token_ids[1]))
        alone.append(int(ref.token_ids[1]))
        # logprobs come from the raw logits, for both rows
        assert torch.equal(out.logprobs[1], ref.logprobs[1])
        if matcher.advance(ours[-1]):
            return ours, free, alone
    raise AssertionError("grammar never completed")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1.0, top_k=50, seed=7),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_rows_follow_the_schema_and_others_are_untouched(tok, compiler, params,
                                                                     seed):
    ours, free, alone = _walk(compiler, SPEC, params, seed)
    text = tok.decode(ours)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert free == alone


def test_masks_touch_only_constrained_rows_and_allow_exactly_the_grammar(tok, compiler):
    m = compiler.matcher(SPEC)
    logits = torch.randn(3, VOCAB)
    out = apply_grammar_masks(logits, [None, m, None], owned=False)
    assert out is not logits and torch.equal(logits[[0, 2]], out[[0, 2]])
    allowed = torch.isfinite(out[1])
    assert torch.equal(out[1][allowed], logits[1][allowed])
    # only '{'-opening tokens may start an object, and EOS may not
    texts = [tok.decode([t]) for t in allowed.nonzero().flatten().tolist()]
    assert texts and all(t.startswith("{") for t in texts)
    assert not allowed[tok.eos_token_id]
    assert not allowed[384:].any()  # padding ids are never allowed


def test_torch_masks_equal_xgrammars_own_kernel(tok, compiler):
    import xgrammar as xgr
    ms = [compiler.matcher(SPEC), None, compiler.matcher(SPEC)]
    for t in tok.encode('{"city": "Pa'):
        ms[2].advance(t)
    logits = torch.randn(3, VOCAB)
    ours = apply_grammar_masks(logits, ms, owned=False)
    bitmask = xgr.allocate_token_bitmask(3, VOCAB)
    ms[0].fill_mask(bitmask, 0)
    ms[2].fill_mask(bitmask, 2)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=VOCAB, indices=[0, 2])
    assert torch.equal(ours, ref)


def test_no_constrained_row_is_no_work():
    logits = torch.randn(2, VOCAB)
    assert apply_grammar_masks(logits, None, owned=False) is logits
    assert apply_grammar_masks(logits, [None, None], owned=False) is logits


def test_eos_only_where_the_grammar_may_end(tok, compiler):
    m = compiler.matcher(StructuredOutput(StructuredOutputKind.JSON_SCHEMA,
                                          json.dumps({"type": "integer"})))
    assert m.advance(tok.encode("7")[0]) is False  # "7" may go on ("71")
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    m.fill_mask(mask, 0)
    assert unpack_bitmask(mask, VOCAB)[0, tok.eos_token_id]
    assert m.advance(tok.eos_token_id) is True


def test_a_complete_object_ends_without_eos(tok, compiler):
    m = compiler.matcher(StructuredOutput(StructuredOutputKind.JSON_OBJECT))
    ids = tok.encode('{"a": 1}')
    assert [m.advance(t) for t in ids] == [False] * (len(ids) - 1) + [True]


def test_forbidden_token_raises(tok, compiler):
    m = compiler.matcher(StructuredOutput(StructuredOutputKind.JSON_OBJECT))
    with pytest.raises(ValueError, match="not allowed"):
        m.advance(tok.encode("x")[0])


def test_tool_call_wrapper_parses_as_a_hermes_call(tok, compiler):
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "arguments": SCHEMA},
            "required": ["name", "arguments"], "additionalProperties": False}
    spec = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(call),
                            "<tool_call>\n", "\n</tool_call>")
    ours, _, _ = _walk(compiler, spec, SamplingParams(temperature=0.0), seed=5)
    text = tok.decode(ours)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    calls = parse_calls(text[len("<tool_call>"):-len("</tool_call>")])
    assert calls is not None and len(calls) == 1 and calls[0].name == "get_weather"
    parsed = calls[0]
    jsonschema.validate(json.loads(parsed.arguments), SCHEMA)


def test_compiled_once_per_spec_with_lru_eviction(tok):
    c = GrammarCompiler(tok, VOCAB, [tok.eos_token_id], cache_size=2)
    specs = [StructuredOutput(StructuredOutputKind.JSON_SCHEMA,
                              json.dumps({"type": "object", "required": [f"k{i}"]}))
             for i in range(3)]
    first = c.compile(specs[0])
    assert c.compile(StructuredOutput(StructuredOutputKind.JSON_SCHEMA,
                                      specs[0].json_schema)) is first
    c.compile(specs[1])
    c.compile(specs[2])  # evicts specs[0]
    assert c.compile(specs[0]) is not first


@pytest.mark.parametrize("schema", ['{"type": "objekt"}', '{"$ref": "#/nowhere"}'])
def test_bad_schema_is_a_value_error(compiler, schema):
    with pytest.raises(ValueError):
        compiler.matcher(StructuredOutput(StructuredOutputKind.JSON_SCHEMA, schema))


@pytest.mark.parametrize("so", [None, SPEC, StructuredOutput(StructuredOutputKind.JSON_OBJECT),
                                StructuredOutput(StructuredOutputKind.JSON_SCHEMA, "{}",
                                                 "<tool_call>\n", "\n</tool_call>")])
def test_structured_output_round_trips_the_wire(so):
    sp = SamplingParams(structured_output=so)
    assert sampling_params_from_proto(sampling_params_to_proto(sp)) == sp


@pytest.mark.parametrize("kw", [dict(kind=StructuredOutputKind.JSON_SCHEMA, json_schema="{"),
                                dict(kind=StructuredOutputKind.JSON_SCHEMA, json_schema="[1]"),
                                dict(kind=StructuredOutputKind.JSON_OBJECT, json_schema="{}"),
                                dict(kind=0)])
def test_malformed_specs_are_refused(kw):
    with pytest.raises(ValueError):
        StructuredOutput(**kw)


def test_prefix_and_suffix_are_literal_text(tok, compiler):
    spec = StructuredOutput(StructuredOutputKind.JSON_OBJECT, "", 'héllo "q" \\\n', "\n日本")
    m = compiler.matcher(spec)
    ids = tok.encode('héllo "q" \\\n{"a": 1}\n日本')
    assert [m.advance(t) for t in ids] == [False] * (len(ids) - 1) + [True]
