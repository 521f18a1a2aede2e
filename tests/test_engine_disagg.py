"""Engine-level prefill → decode hand-off (no RPC): two engines, blocks copied between their
KV tensors exactly as a transport would. Outputs equal the colocated engine and transformers."""
import random

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.block_holds import BlockHolds
from baton.engine.remote_kv import PDRequest, RemoteKV
from baton.engine.request import RequestStatus
from baton.pd_cost import PDPolicy, PDRates
from tests.reference import hf_greedy

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engines(folder, **kw):
    """(prefill engine with its BlockHolds, decode engine with its RemoteKV)."""
    prefill = LLM(str(folder), block_size=8, num_blocks=64, **kw).engine
    decode = LLM(str(folder), block_size=8, num_blocks=64, **kw).engine
    return (prefill, BlockHolds(prefill)), (decode, RemoteKV(decode))


def _drain(engine, rid):
    tokens = []
    for _ in range(200):
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens
    raise AssertionError("request did not finish")


def _remote_turn(p, d, rid, prompt, params=PARAMS):
    """One disaggregated request. Returns (output tokens, blocks transferred)."""
    (prefill, holds), (decode, rkv) = p, d
    plan, _, _ = rkv.add(rid, prompt, params, min_remote_tokens=1)
    assert plan is not None
    holds.add(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = _drain(prefill, rid)
    src = holds.block_table(rid)[plan.num_cached_tokens // 8:]
    assert len(src) == len(plan.dst_block_ids)
    decode.kv_cache[torch.tensor(plan.dst_block_ids)] = prefill.kv_cache[torch.tensor(src)]
    out = rkv.finish(rid, first[0])
    assert holds.release(rid)
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
    for e in (prefill[0], decode[0]):
        assert e.kv.num_free_blocks == e.kv.num_blocks
    assert len(prefill[1]) == 0


def test_short_suffix_prefills_locally(tiny_llama):
    _, (decode, rkv) = _engines(tiny_llama)
    plan, req, _ = rkv.add("x", list(range(3, 20)), PARAMS, min_remote_tokens=64)
    assert plan is None and req.status == RequestStatus.WAITING
    assert _drain(decode, "x") == hf_greedy(tiny_llama, list(range(3, 20)), 8)


@pytest.mark.parametrize("recompute", [True, False])
def test_failed_remote_prefill_recomputes_or_errors(tiny_qwen3, recompute):
    _, (decode, rkv) = _engines(tiny_qwen3)
    prompt = list(range(5, 40))
    plan, _, _ = rkv.add("r", prompt, PARAMS, min_remote_tokens=1)
    decode.kv_cache[torch.tensor(plan.dst_block_ids)] = 7.0  # garbage "partial" KV
    failure = rkv.fail("r", recompute=recompute)
    out = failure.output
    assert failure.hold_id is None
    if recompute:
        assert out is None
        assert _drain(decode, "r") == hf_greedy(tiny_qwen3, prompt, 8)
    else:
        assert out.finished and out.finish_reason == "error"
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_abort_while_waiting_for_remote_kv_frees_blocks(tiny_qwen3):
    _, (decode, rkv) = _engines(tiny_qwen3)
    rkv.add("r", list(range(5, 40)), PARAMS, min_remote_tokens=1)
    assert decode.get_request("r").status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert decode.kv.num_free_blocks < decode.kv.num_blocks
    out = decode.abort_request("r")
    assert out.finish_reason == "abort"
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_held_blocks_released_by_abort(tiny_qwen3):
    (prefill, holds), _ = _engines(tiny_qwen3)
    holds.add("p", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=1))
    _drain(prefill, "p")
    assert holds.block_table("p") and "p" in holds
    assert holds.abort("p") is None  # finished: nothing left in the engine, the hold ends
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks and len(holds) == 0


def test_only_normally_finished_requests_added_as_held_are_held(tiny_qwen3):
    (prefill, holds), _ = _engines(tiny_qwen3)
    one = SamplingParams(temperature=0, max_tokens=1)
    prefill.add_request("plain", list(range(5, 30)), one)  # not added through the holds
    holds.add("aborted", list(range(7, 30)), one)
    assert holds.abort("aborted").finish_reason == "abort"
    _drain(prefill, "plain")
    assert len(holds) == 0 and prefill.kv.num_free_blocks == prefill.kv.num_blocks
    with pytest.raises(KeyError):
        holds.block_table("plain")


@pytest.mark.parametrize("recompute", [True, False])
def test_blocks_a_late_write_may_reach_are_set_aside_until_released(tiny_qwen3, recompute):
    """An unconfirmed transfer may still write into the destination blocks: they leave the
    request (which recomputes into fresh blocks, or ends) and no other request gets them
    until the hold is released."""
    _, (decode, rkv) = _engines(tiny_qwen3)
    prompt = list(range(5, 40))
    plan, _, _ = rkv.add("r", prompt, PARAMS, min_remote_tokens=1)
    failure = rkv.fail("r", recompute=recompute, writes_may_land=True, aborted=not recompute)
    assert failure.hold_id is not None and rkv.num_held_blocks == len(plan.dst_block_ids)
    if recompute:
        assert failure.output is None
        decode.kv_cache[torch.tensor(plan.dst_block_ids)] = 7.0  # the late write lands
        assert _drain(decode, "r") == hf_greedy(tiny_qwen3, prompt, 8)
    else:
        assert failure.output.finish_reason == "abort"
    assert decode.kv.num_free_blocks == decode.kv.num_blocks - len(plan.dst_block_ids)
    assert rkv.release_hold(failure.hold_id) and not rkv.release_hold(failure.hold_id)
    assert rkv.num_held_blocks == 0 and decode.kv.num_free_blocks == decode.kv.num_blocks


def test_finish_or_fail_of_a_request_not_waiting_raises(tiny_qwen3):
    _, (decode, rkv) = _engines(tiny_qwen3)
    decode.add_request("local", list(range(5, 20)), PARAMS)
    for call in (lambda: rkv.finish("local", 3), lambda: rkv.fail("local", recompute=True),
                 lambda: rkv.finish("unknown", 3)):
        with pytest.raises(KeyError):
            call()
    assert decode.get_request("local").status == RequestStatus.WAITING


def test_seeded_sampling_disaggregated_equals_colocated(tiny_llama):
    """The prefill worker draws the first token from the seed; decode skips that draw."""
    (prefill, holds), (decode, rkv) = _engines(tiny_llama)
    (colocated, _), _ = _engines(tiny_llama)
    params = SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=8, ignore_eos=True)
    prompt = list(range(5, 34))
    plan, _, _ = rkv.add("s", prompt, params, min_remote_tokens=1)
    holds.add("s", prompt, SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=1,
                                          ignore_eos=True))
    first = _drain(prefill, "s")
    src = holds.block_table("s")
    decode.kv_cache[torch.tensor(plan.dst_block_ids)] = prefill.kv_cache[torch.tensor(src)]
    out = rkv.finish("s", first[0])
    colocated.add_request("s", prompt, params)
    assert out.new_token_ids + _drain(decode, "s") == _drain(colocated, "s")


def test_the_cost_model_decides_with_the_prefix_hit(tiny_llama):
    """RemoteKV.add(pd=...): the P/D cost model decides on the engine thread with decode's
    own prefix hit (here by a fixed threshold of 1 token, so the path is known) and, once
    the engine has measured one, its per-step prefill rate."""
    _, (decode, rkv) = _engines(tiny_llama)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 380) for _ in range(37)]
    local = PDRequest(0, PDRates(), PDPolicy(itl_budget_s=1.0), block_bytes=1024)
    plan, _, d = rkv.add("a", prompt, PARAMS, pd=local)
    assert plan is None and (d.reason, d.stall_s) == ("faster_local", 37 / 2000)
    _drain(decode, "a")  # prefilled here: its 4 full prompt blocks are now cached
    measured = decode.prefill_rate.tokens_per_s  # that step's rate now prices the local path
    assert measured > 0
    remote = PDRequest(0, PDRates(), PDPolicy(min_remote_tokens=1), block_bytes=1024)
    plan, _, d = rkv.add("b", prompt + [5, 6], PARAMS, pd=remote)
    assert (d.reason, d.stall_s) == ("threshold", 7 / measured) and plan.num_cached_tokens == 32
    assert decode.get_request("b").status == RequestStatus.WAITING_FOR_REMOTE_KV
    rkv.fail("b", recompute=False, aborted=True)


@pytest.mark.parametrize("gemm,gemv", [("bf16", ""), ("fp32", ""), ("bf16", "avx512")])
def test_bf16_disaggregated_equals_colocated_token_for_token(tiny_llama, gemm, gemv, monkeypatch):
    """bf16 cannot match fp32 transformers token for token, but a disaggregated request runs the
    same kernels as a colocated one (torch's bf16 GEMM for the prompt, or its fp32 one where
    the CPU's bf16 products are slow: `gemm`, forced; the batch-invariant native bf16 GEMV for
    decode: AMX's where it runs, or the AVX512_BF16 one, `gemv`, forced) over the same bf16
    KV bytes, so their tokens are equal. Fresh prompts only: a prefix hit at another boundary
    on either side is another computation."""
    monkeypatch.setenv("BATON_BF16_GEMM", gemm)
    monkeypatch.setenv("BATON_BF16_GEMV", gemv)
    prefill, decode = _engines(tiny_llama, dtype="bfloat16")
    colocated = LLM(str(tiny_llama), dtype="bfloat16", block_size=8, num_blocks=64)
    assert decode[0].kv_cache.dtype == prefill[0].kv_cache.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(7)
    for i, n in enumerate((9, 16, 17, 37, 64)):
        prompt = [rng.randrange(3, 380) for _ in range(n)]
        tokens, sent = _remote_turn(prefill, decode, f"bf{i}", prompt, params)
        assert sent == -(-n // 8)
        assert tokens == colocated.generate([prompt], params)[0].output_token_ids, f"{n} tokens"
