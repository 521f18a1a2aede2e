"""Structured outputs across the workers (tiny model, both transports): the spec crosses the
wire to both roles, a remote prefill's first token follows the grammar and the decode side
continues it exactly as colocated; a schema the grammar library refuses is INVALID_ARGUMENT."""
from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from baton import LLM
from baton.sampling_params import SamplingParams, StructuredOutput, StructuredOutputKind
from tests.services.helpers import BLOCK
from tests.services.test_disagg_e2e import prompt_of
from tests.test_grammar_engine import SCHEMA

pytestmark = pytest.mark.asyncio(loop_scope="module")
SPEC = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def colocated(model):
    """The servers' engine settings, in-process: the reference for token-exact checks."""
    return LLM(str(model), block_size=BLOCK, num_blocks=96, dtype="float32")


async def test_remote_prefill_follows_the_grammar_like_colocated(whole, colocated):
    _, _, client = whole
    for seed, params in ((1, SamplingParams(temperature=0, max_tokens=200,
                                            structured_output=SPEC)),
                         (2, SamplingParams(temperature=0.9, seed=5, max_tokens=200,
                                            structured_output=SPEC))):
        prompt = prompt_of(37, seed=seed + 40)
        res = await client.generate(prompt, params)
        assert res.fin.timings.remote_prefill
        assert res.output == colocated.generate([prompt], params)[0].output_token_ids
        jsonschema.validate(json.loads(res.text[0]), SCHEMA)


async def test_a_schema_that_does_not_compile_is_invalid_argument(whole):
    _, _, client = whole
    bad = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(
        {"type": "string", "pattern": "(?<=a)b"}))  # valid JSON Schema, no lookbehind here
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate(prompt_of(37, seed=9), SamplingParams(structured_output=bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Lookbehind" in e.value.details()
    # the refused field, for the gateway to name its own (issue 27)
    assert dict(e.value.trailing_metadata())["baton-field"] == \
        "sampling_params.structured_output"
