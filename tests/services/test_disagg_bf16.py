"""bf16 disaggregated serving over both transports equals the colocated bf16 engine token for
token: the prefill worker's prompt (torch's bf16 GEMM) and the decode worker's steps (the
batch-invariant native bf16 GEMV) are the colocated engine's computations, and the KV crosses the
wire as bf16 bytes (half of fp32's), unconverted. Fresh prompts only (a prefix hit at another
block boundary would be another computation), below and above the local-prefill threshold."""
from __future__ import annotations

import dataclasses
import random

import pytest
import pytest_asyncio
import torch

from baton import LLM
from baton.sampling_params import SamplingParams
from tests.services.conftest import TRANSPORTS
from tests.services.helpers import (
    BLOCK,
    FORCE_REMOTE,
    engine_config,
    pools_whole,
    start_pair,
    stop_pair,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_llama_d32"])
def model(request):
    """head_dim 16 and 32: on a CPU with AMX the second takes the AMX prefill attention on both
    sides (kernels/cpu_prefill.py), the first the AVX512_BF16 one."""
    return request.getfixturevalue(request.param)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=TRANSPORTS)
async def bf16_pair(request, model):
    pair = await start_pair(model, request.param,
                            dataclasses.replace(engine_config(model), dtype="bfloat16"),
                            **FORCE_REMOTE)
    yield pair
    await stop_pair(*pair)


@pytest.fixture(scope="module")
def colocated(model):
    return LLM(str(model), dtype="bfloat16", block_size=BLOCK, num_blocks=96)


async def test_bf16_disaggregated_equals_colocated(bf16_pair, colocated):
    prefill, decode, client = bf16_pair
    for server in (prefill, decode):
        assert server.engine.runner.kv_cache.dtype == torch.bfloat16
    rng = random.Random(11)
    for n, remote in ((10, False), (17, True), (37, True), (61, True)):  # threshold: 16 tokens
        prompt = [rng.randrange(3, 380) for _ in range(n)]
        res = await client.generate(prompt, PARAMS)
        assert res.fin.timings.remote_prefill is remote
        assert res.output == colocated.generate([prompt], PARAMS)[0].output_token_ids, f"{n} tokens"
    await pools_whole(prefill, decode)
