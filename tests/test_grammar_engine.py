"""Structured outputs through the engine (tiny random Llama): constrained requests batched with
unconstrained ones, the grammar's end stops the request, disaggregated == colocated."""
import json

import jsonschema
import pytest
import torch

from baton import LLM, SamplingParams
from baton.sampling_params import StructuredOutput, StructuredOutputKind
from tests.test_engine_disagg import _drain, _engines

# Bounded everywhere, so even a random model's greedy walk ends.
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["city", "n", "ok"], "additionalProperties": False}
SPEC = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
PROMPT = list(range(5, 34))


def _run(engine, rid):
    tokens, last = [], None
    for _ in range(300):
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                last = out
        if last is not None and last.finished:
            return tokens, last
    raise AssertionError("request did not finish")


def test_constrained_and_free_requests_share_a_batch(tiny_llama):
    engine = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("free", PROMPT[:9], free)
    engine.add_request("json", PROMPT, SamplingParams(temperature=0.0, max_tokens=200,
                                                      structured_output=SPEC))
    engine.add_request("json_t", PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=200,
                                                        structured_output=SPEC))
    outs: dict[str, list[int]] = {"free": [], "json": [], "json_t": []}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid in ("json", "json_t"):
        jsonschema.validate(json.loads(engine.tokenizer.decode(outs[rid])), SCHEMA)
        assert reasons[rid] == "stop"
        assert engine.eos_token_ids.isdisjoint(outs[rid])  # ended by the grammar, not by EOS
    alone = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    alone.add_request("free", PROMPT[:9], free)
    assert outs["free"] == _run(alone, "free")[0]


def test_json_object_gives_an_object(tiny_llama):
    engine = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    engine.add_request("o", PROMPT, SamplingParams(
        temperature=0.7, seed=11, max_tokens=200,
        structured_output=StructuredOutput(StructuredOutputKind.JSON_OBJECT)))
    tokens, last = _run(engine, "o")
    if last.finish_reason == "stop":  # a random model may write a long string: then "length"
        assert isinstance(json.loads(engine.tokenizer.decode(tokens)), dict)
    else:
        assert engine.tokenizer.decode(tokens).startswith("{")


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 21)])
def test_disaggregated_equals_colocated_under_a_schema(tiny_llama, temperature, seed):
    (prefill, holds), (decode, rkv) = _engines(tiny_llama)
    (colocated, _), _ = _engines(tiny_llama)
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=200,
                            structured_output=SPEC)
    plan, _, _ = rkv.add("s", PROMPT, params, min_remote_tokens=1)
    # the prefill worker's params: the decode side's, for one token (prefill_service/worker.py)
    holds.add("s", PROMPT, SamplingParams(temperature=temperature, seed=seed, max_tokens=1,
                                          structured_output=SPEC))
    first = _drain(prefill, "s")
    decode.kv_cache[torch.tensor(plan.dst_block_ids)] = \
        prefill.kv_cache[torch.tensor(holds.block_table("s"))]
    out = rkv.finish("s", first[0])
    disagg = out.new_token_ids + _run(decode, "s")[0]
    colocated.add_request("s", PROMPT, params)
    assert disagg == _run(colocated, "s")[0]
    jsonschema.validate(json.loads(decode.tokenizer.decode(disagg)), SCHEMA)


def test_a_first_token_the_grammar_forbids_ends_the_request(tiny_llama):
    _, (decode, rkv) = _engines(tiny_llama)
    rkv.add("s", PROMPT, SamplingParams(max_tokens=50, structured_output=SPEC),
            min_remote_tokens=1)
    bad = decode.tokenizer.encode("x")[0]
    out = rkv.finish("s", bad)
    assert out.finished and out.finish_reason == "error" and "not allowed" in out.error
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_a_schema_that_does_not_compile_is_refused(tiny_llama):
    engine = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    bad = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, '{"type": "objekt"}')
    with pytest.raises(ValueError, match="json_schema"):
        engine.add_request("bad", PROMPT, SamplingParams(structured_output=bad))
    assert "bad" not in engine.requests


def test_a_grammar_complete_on_the_last_allowed_token_is_a_stop(tiny_llama):
    engine = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_output=SPEC)
    engine.add_request("a", PROMPT, params)
    tokens, _ = _run(engine, "a")
    engine.add_request("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=len(tokens),
                                                   structured_output=SPEC))
    again, last = _run(engine, "b")
    assert again == tokens and last.finish_reason == "stop"


def test_n2_completions_each_follow_the_grammar(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=200,
                                                structured_output=SPEC))[0]
    assert len(out.outputs) == 2
    for comp in out.outputs:
        assert comp.finish_reason == "stop"
        jsonschema.validate(json.loads(comp.text), SCHEMA)
