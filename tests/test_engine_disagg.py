"""Engine-level prefill → decode hand-off (no RPC): two engines, blocks copied between their
KV tensors exactly as a transport would. Outputs equal the colocated engine and transformers."""
import random

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.request import RequestStatus
from tests.reference import hf_greedy

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engines(folder, **kw):
    return LLM(str(folder), block_size=8, num_blocks=64, **kw).engine, \
        LLM(str(folder), block_size=8, num_blocks=64, **kw).engine


def _drain(engine, rid):
    tokens = []
    for _ in range(200):
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens
    raise AssertionError("request did not finish")


def _remote_turn(prefill, decode, rid, prompt, params=PARAMS):
    """One disaggregated request. Returns (output tokens, blocks transferred)."""
    plan = decode.add_remote_request(rid, prompt, params, min_remote_tokens=1)
    assert plan is not None
    prefill.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                    ignore_eos=True), hold_blocks=True)
    first = _drain(prefill, rid)
    src = prefill.held_block_table(rid)[plan.num_cached_tokens // 8:]
    assert len(src) == len(plan.dst_block_ids)
    decode.runner.kv_cache[torch.tensor(plan.dst_block_ids)] = \
        prefill.runner.kv_cache[torch.tensor(src)]
    out = decode.finish_remote_prefill(rid, first[0])
    assert prefill.release_blocks(rid)
    return out.new_token_ids + _drain(decode, rid), len(src)


def test_disaggregated_equals_reference_and_transfers_only_new_blocks(tiny_llama):
    prefill, decode = _engines(tiny_llama)
    rng = random.Random(0)
    turn1 = [rng.randrange(3, 380) for _ in range(37)]
    tokens1, sent1 = _remote_turn(prefill, decode, "a", turn1)
    assert tokens1 == hf_greedy(tiny_llama, turn1, 8)
    assert sent1 == 5  # ceil(37 / 8)
    # Next turn: the whole previous context plus new tokens. The decode side holds the
    # first turn's full blocks (prompt + output, 45 tokens → 5 full blocks).
    turn2 = turn1 + tokens1 + [rng.randrange(3, 380) for _ in range(20)]
    tokens2, sent2 = _remote_turn(prefill, decode, "b", turn2)
    assert tokens2 == hf_greedy(tiny_llama, turn2, 8)
    assert sent2 == -(-len(turn2) // 8) - 5  # only the blocks decode lacks
    for e in (prefill, decode):
        assert e.kv.num_free_blocks == e.kv.num_blocks and not e.held


def test_short_suffix_prefills_locally(tiny_llama):
    _, decode = _engines(tiny_llama)
    assert decode.add_remote_request("x", list(range(3, 20)), PARAMS, min_remote_tokens=64) \
        is None
    assert _drain(decode, "x") == hf_greedy(tiny_llama, list(range(3, 20)), 8)


@pytest.mark.parametrize("recompute", [True, False])
def test_failed_remote_prefill_recomputes_or_errors(tiny_qwen3, recompute):
    _, decode = _engines(tiny_qwen3)
    prompt = list(range(5, 40))
    plan = decode.add_remote_request("r", prompt, PARAMS, min_remote_tokens=1)
    decode.runner.kv_cache[torch.tensor(plan.dst_block_ids)] = 7.0  # garbage "partial" KV
    out = decode.fail_remote_prefill("r", recompute=recompute)
    if recompute:
        assert out is None
        assert _drain(decode, "r") == hf_greedy(tiny_qwen3, prompt, 8)
    else:
        assert out.finished and out.finish_reason == "error"
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_abort_while_waiting_for_remote_kv_frees_blocks(tiny_qwen3):
    _, decode = _engines(tiny_qwen3)
    decode.add_remote_request("r", list(range(5, 40)), PARAMS, min_remote_tokens=1)
    assert decode.requests["r"].request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert decode.kv.num_free_blocks < decode.kv.num_blocks
    out = decode.abort_request("r")
    assert out.finish_reason == "abort"
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_held_blocks_released_by_abort(tiny_qwen3):
    prefill, _ = _engines(tiny_qwen3)
    prefill.add_request("p", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=1),
                        hold_blocks=True)
    _drain(prefill, "p")
    assert prefill.held_block_table("p")
    prefill.abort_request("p")
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks and not prefill.held


def test_seeded_sampling_disaggregated_equals_colocated(tiny_llama):
    """The prefill worker draws the first token from the seed; decode skips that draw."""
    prefill, decode = _engines(tiny_llama)
    colocated, _ = _engines(tiny_llama)
    params = SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=8, ignore_eos=True)
    prompt = list(range(5, 34))
    plan = decode.add_remote_request("s", prompt, params, min_remote_tokens=1)
    prefill.add_request("s", prompt, SamplingParams(temperature=0.9, top_k=40, seed=77,
                                                    max_tokens=1, ignore_eos=True),
                        hold_blocks=True)
    first = _drain(prefill, "s")
    src = prefill.held_block_table("s")
    decode.runner.kv_cache[torch.tensor(plan.dst_block_ids)] = \
        prefill.runner.kv_cache[torch.tensor(src)]
    out = decode.finish_remote_prefill("s", first[0])
    colocated.add_request("s", prompt, params)
    assert out.new_token_ids + _drain(decode, "s") == _drain(colocated, "s")
