"""Token-exact disaggregated serving: prefill → KV transfer → decode equals transformers and
the colocated engine, below and above the local-prefill threshold, with prefix hits on
either side; only the blocks decode lacks are transferred."""
from __future__ import annotations

import random

import pytest

from baton import LLM
from baton.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2
from tests.reference import hf_greedy
from tests.services.helpers import BLOCK, FORCE_REMOTE, GREEDY, Client, start_decode

pytestmark = pytest.mark.asyncio(loop_scope="module")


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def sent_blocks(prefill) -> float:
    return prefill.metrics.registry.get_sample_value("baton_kv_transferred_blocks_total") or 0


def pulled(prefill) -> float:
    return prefill.metrics.registry.get_sample_value("baton_prefill_pulled_tokens_total") or 0


def recomputed_held(decode) -> float:
    return decode.metrics.registry.get_sample_value(
        "baton_decode_recomputed_held_tokens_total") or 0


@pytest.fixture(scope="module")
def colocated(model):
    return LLM(str(model), block_size=BLOCK, num_blocks=96, dtype="float32")


async def test_below_and_above_threshold_match_reference(whole, model, colocated):
    prefill, decode, client = whole
    for n, remote in ((10, False), (37, True)):  # decode's --min-remote-tokens is 16
        prompt = prompt_of(n, seed=n)
        before = sent_blocks(prefill)
        res = await client.generate(prompt)
        assert res.output == hf_greedy(model, prompt, 8)
        assert res.output == colocated.generate([prompt], GREEDY)[0].output_token_ids
        assert res.fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert res.fin.timings.remote_prefill is remote
        assert sent_blocks(prefill) - before == (-(-n // BLOCK) if remote else 0)
        assert res.fin.usage.prompt_tokens == n and res.fin.usage.completion_tokens == 8


async def test_second_turn_transfers_only_new_blocks(whole, model):
    """Case 5: decode's hit ends at a block edge inside turn 1's output (45 tokens → 40
    cached), prefill's hit ends elsewhere (its own turn-1 prompt: 32 cached): the prefill
    worker reads the block it lacks from decode (kv_pull.py) instead of recomputing it."""
    prefill, decode, client = whole
    turn1 = prompt_of(37, seed=1)
    out1 = (await client.generate(turn1)).output
    turn2 = turn1 + out1 + prompt_of(20, seed=2)  # 65 tokens, 9 blocks
    before, pulled_before = sent_blocks(prefill), pulled(prefill)
    held_before = recomputed_held(decode)
    res = await client.generate(turn2)
    assert res.output == hf_greedy(model, turn2, 8)
    assert sent_blocks(prefill) - before == 9 - 5  # decode holds 5 full blocks (40 tokens)
    assert pulled(prefill) - pulled_before == 8  # the one block prefill lacked: read
    assert res.fin.usage.cached_tokens == 40  # nobody computed what decode held
    assert res.fin.timings.remote_prefill
    usage = res.fin.usage  # counted where decode holds them (its copy is the one used)
    assert [(c.source, c.num_tokens) for c in usage.cached_by] == \
        [(common_pb2.KV_SOURCE_DECODE_POOL, 40)]
    assert usage.recomputed_held_tokens == 0
    assert recomputed_held(decode) - held_before == 0


async def test_a_pull_that_fails_is_computed_instead(whole, model, monkeypatch):
    """The prefill worker cannot read what decode holds (here: its transport refuses the
    pull): it computes those tokens itself, the output is unchanged, and the usage says the
    held tokens were recomputed."""
    prefill, decode, client = whole
    turn1 = prompt_of(37, seed=11)
    out1 = (await client.generate(turn1)).output
    turn2 = turn1 + out1 + prompt_of(20, seed=12)

    def refuse(self, *args, **kwargs):
        raise RuntimeError("no pulls today")

    monkeypatch.setattr(type(prefill.sender), "pull", refuse)
    pulled_before = pulled(prefill)
    res = await client.generate(turn2)
    assert res.output == hf_greedy(model, turn2, 8) and res.fin.timings.remote_prefill
    assert pulled(prefill) == pulled_before
    assert (res.fin.usage.cached_tokens, res.fin.usage.recomputed_held_tokens) == (32, 8)


async def test_without_the_pull_held_blocks_are_recomputed(whole, model):
    """--no-kv-pull: decode names no src blocks, the prefill worker computes what it lacks
    (the store, when configured, is then the only way not to): usage says so."""
    prefill, decode, _ = whole
    other = await start_decode(model, decode.config.transport, prefill.address,
                               kv_pull=False, **FORCE_REMOTE)
    client = Client(other.address)
    try:
        turn1 = prompt_of(37, seed=21)
        out1 = (await client.generate(turn1)).output
        turn2 = turn1 + out1 + prompt_of(20, seed=22)
        pulled_before = pulled(prefill)
        res = await client.generate(turn2)
        assert res.output == hf_greedy(model, turn2, 8) and res.fin.timings.remote_prefill
        assert pulled(prefill) == pulled_before
        assert (res.fin.usage.cached_tokens, res.fin.usage.recomputed_held_tokens) == (32, 8)
    finally:
        await client.close()
        await other.stop(drain_s=0)


async def test_prefill_hit_beyond_decode_hit(whole, model):
    """Fresh decode workers (no hit) after the prefill worker cached the whole prompt:
    prefill computes one block, all blocks are sent, output unchanged."""
    prefill, decode, _ = whole
    prompt = prompt_of(41, seed=3)
    for turn in range(2):
        other = await start_decode(model, decode.config.transport, prefill.address,
                                   **FORCE_REMOTE)
        client = Client(other.address)
        try:
            before = sent_blocks(prefill)
            res = await client.generate(prompt)
            assert res.output == hf_greedy(model, prompt, 8)
            assert sent_blocks(prefill) - before == 6
            assert res.fin.usage.cached_tokens == (40 if turn else 0)
            by = [(c.source, c.num_tokens) for c in res.fin.usage.cached_by]
            assert by == ([(common_pb2.KV_SOURCE_PREFILL_POOL, 40)] if turn else [])
            assert res.fin.usage.recomputed_held_tokens == 0
        finally:
            await client.close()
            await other.stop(drain_s=0)


async def test_n2_seeded_sampling_and_logprobs_match_colocated(whole, colocated):
    _, _, client = whole
    prompt = prompt_of(30, seed=4)
    params = SamplingParams(n=2, temperature=0.9, top_k=50, seed=1234, max_tokens=6,
                            ignore_eos=True, logprobs=2)
    res = await client.generate(prompt, params)
    ref = colocated.generate([prompt], params)[0]
    assert res.tokens[0] == ref.outputs[0].token_ids
    assert res.tokens[1] == ref.outputs[1].token_ids
    assert sorted(res.finished) == [0, 1]
    assert res.finished[0].usage == res.finished[1].usage
    assert res.finished[0].usage.completion_tokens == 12
    lps = [lp for c in res.chunks if c.index == 0 for lp in c.logprobs]
    assert len(lps) == 6 and all(len(lp.top) == 2 for lp in lps)
    want = [lp.logprob for lp in ref.outputs[0].logprobs]
    assert [lp.logprob for lp in lps] == pytest.approx(want, abs=1e-4)


async def test_penalties_and_logit_bias_apply_on_prefill_and_decode(whole, colocated):
    """They cross the wire (baton/worker/wire.py) to both roles: the remote prefill samples
    the first token, decode the rest, and both match the colocated engine."""
    _, _, client = whole
    # fresh prompts above --min-remote-tokens: the first token is the prefill worker's
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            logit_bias={42: 100.0})
    res = await client.generate(prompt_of(37, seed=5), biased)
    assert res.fin.timings.remote_prefill and res.output == [42] * 6
    prompt = prompt_of(37, seed=6)
    penalized = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                               presence_penalty=1.5, frequency_penalty=1.0,
                               repetition_penalty=1.3, logit_bias={7: 3.0, 11: -100.0})
    res = await client.generate(prompt, penalized)
    assert res.fin.timings.remote_prefill
    assert res.output == colocated.generate([prompt], penalized)[0].output_token_ids
    assert res.output != (await client.generate(prompt, GREEDY)).output


async def test_min_tokens_bans_eos_on_the_remote_prefill_too(whole, colocated):
    """The remote prefill samples the first token: with min_tokens it may not be eos
    (vLLM's min_tokens), however much the model wants to end."""
    _, _, client = whole
    eos = min(colocated.engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, logit_bias={eos: 100.0})
    prompt = prompt_of(37, seed=7)
    res = await client.generate(prompt, params)
    assert res.fin.timings.remote_prefill and res.output[3:] == [eos]
    assert eos not in res.output[:3]
    assert res.output == colocated.generate([prompt], params)[0].output_token_ids


async def test_prefill_modes(whole, model):
    prefill, _, client = whole
    short, long = prompt_of(12, seed=5), prompt_of(40, seed=6)
    res = await client.generate(short, prefill_mode=decode_pb2.PREFILL_MODE_REMOTE)
    assert res.fin.timings.remote_prefill and res.output == hf_greedy(model, short, 8)
    res = await client.generate(long, prefill_mode=decode_pb2.PREFILL_MODE_LOCAL)
    assert not res.fin.timings.remote_prefill and res.output == hf_greedy(model, long, 8)


async def test_stats_and_metrics(whole):
    prefill, decode, client = whole
    await client.generate(prompt_of(33, seed=7))
    d = await client.stats()
    p = await client.stats(client.prefill)
    assert d.num_free_blocks == d.num_total_blocks == 96 and d.num_cached_blocks > 0
    assert set(d.snapshot.block_hashes) and d.kv_layout.block_size == BLOCK
    assert p.num_free_blocks == p.num_total_blocks and set(p.snapshot.block_hashes)
    reg = decode.metrics.registry
    assert reg.get_sample_value("baton_ttft_seconds_count") >= 1
    assert reg.get_sample_value("baton_itl_seconds_count") >= 1
    assert reg.get_sample_value("baton_kv_received_bytes_total") > 0
    assert reg.get_sample_value("baton_kv_free_blocks") == 96
    assert prefill.metrics.registry.get_sample_value("baton_kv_transferred_bytes_total") > 0
    # the vLLM-named series: TTFT/ITL where the stream is, prefix-cache counts on both sides
    dv, pv = _vllm(reg), _vllm(prefill.metrics.registry)
    assert dv["vllm:time_to_first_token_seconds_count"] >= 1
    assert dv["vllm:inter_token_latency_seconds_count"] >= 7
    assert dv["vllm:generation_tokens_total"] >= 8 and dv["vllm:kv_cache_usage_perc"] == 0.0
    assert pv["vllm:prefix_cache_queries_total"] >= 33 and pv["vllm:prompt_tokens_total"] >= 33
    assert dv["vllm:prefix_cache_queries_total"] >= 33  # the remote-KV wait's lookup
    assert pv["vllm:num_requests_running"] == pv["vllm:num_requests_waiting"] == 0


def _vllm(registry) -> dict[str, float]:
    """vllm:* sample name → value (the one model_name/engine series each has here)."""
    return {s.name: s.value for m in registry.collect() for s in m.samples
            if s.name.startswith("vllm:") and "le" not in s.labels}


async def test_concurrent_mixed_requests_match_reference(whole, model):
    """Remote and local prefills batched together on both workers, token order intact."""
    import asyncio

    _, _, client = whole
    prompts = [prompt_of(n, seed=100 + n) for n in (9, 17, 24, 33, 40, 47, 12, 29)]
    results = await asyncio.gather(*(client.generate(p) for p in prompts))
    for p, res in zip(prompts, results):
        assert res.output == hf_greedy(model, p, 8)
        assert res.fin.timings.remote_prefill is (len(p) >= 16)


async def test_prompt_logprobs_are_computed_on_decode_and_match_colocated(whole, colocated):
    """A prompt above the remote threshold asking for prompt logprobs is prefilled on the
    decode worker (KV carries no logits), whole (no cache read, though turn 1 cached it),
    and each choice's first chunk carries the prompt's logprobs, as the colocated engine's."""
    _, _, client = whole
    prompt = prompt_of(37, seed=9)
    await client.generate(prompt)  # its blocks are cached now, on both workers
    params = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True,
                            prompt_logprobs=3)
    res = await client.generate(prompt, params)
    assert not res.fin.timings.remote_prefill and res.fin.usage.cached_tokens == 0
    ref = colocated.generate([prompt], params)[0].prompt_logprobs[1:]
    for index in (0, 1):
        first = next(c for c in res.chunks if c.index == index)
        got = list(first.prompt_logprobs)
        assert [lp.token_id for lp in got] == prompt[1:]
        assert [lp.logprob for lp in got] == pytest.approx([r.logprob for r in ref], abs=1e-4)
        assert [lp.rank for lp in got] == [r.rank for r in ref]
        assert [[t.token_id for t in lp.top] for lp in got] == [list(r.top) for r in ref]
    assert all(not c.prompt_logprobs for c in res.chunks if c is not res.chunks[0]
               and c.index == 0)
