"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' own model: every
prompt token after the first, its rank and top k, through chunked prefill, a warm prefix
cache (never read for them) and preemption (computed once)."""
import pytest
import torch

from baton import LLM, SamplingParams
from tests.reference import hf_model


def _reference(folder, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits [len(ids), vocab], fp32."""
    with torch.no_grad():
        logits = hf_model(str(folder))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(folder, ids: list[int], got, k: int) -> None:
    ref = _reference(folder, ids)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        lp, row = got[p], ref[p - 1]
        assert lp.token_id == ids[p]
        assert lp.logprob == pytest.approx(float(row[ids[p]]), abs=1e-4)
        assert lp.rank == 1 + int((row > row[ids[p]]).sum())
        top = row.topk(k)
        assert list(lp.top) == top.indices.tolist()
        assert list(lp.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_transformers(tiny_llama, chunk):
    llm = LLM(str(tiny_llama), num_blocks=64, block_size=4, dtype="float32",
              max_num_batched_tokens=chunk or 2048)
    ids = [(i * 37 + 11) % 200 + 3 for i in range(23)]
    warm = llm.generate([ids], SamplingParams(max_tokens=1))[0]  # the prefix is cached now
    assert warm.prompt_logprobs is None
    out = llm.generate([ids], SamplingParams(max_tokens=3, prompt_logprobs=4,
                                             temperature=0))[0]
    _check(tiny_llama, ids, out.prompt_logprobs, 4)
    assert out.num_cached_tokens == 0  # read from no cache: every position was computed
    again = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0))[0]
    assert again.output_token_ids == out.output_token_ids and again.num_cached_tokens > 0
    assert llm.engine.kv.num_free_blocks == 64


def test_prompt_logprobs_zero_one_token_and_n(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=32, block_size=4, dtype="float32")
    ids = [5, 9, 14, 3, 77, 21]
    out = llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=0, n=2,
                                             seed=3))[0]
    _check(tiny_llama, ids, out.prompt_logprobs, 0)
    assert len(out.outputs) == 2
    one = llm.generate([[42]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_survive_preemption(tiny_llama):
    """Two requests that outgrow a small pool: one is preempted, computed again from position
    0, and its prompt logprobs are neither duplicated nor changed."""
    llm = LLM(str(tiny_llama), num_blocks=12, block_size=4, dtype="float32", max_num_seqs=2)
    a = [(i * 13 + 7) % 180 + 3 for i in range(14)]
    b = [(i * 29 + 5) % 180 + 3 for i in range(14)]
    params = SamplingParams(max_tokens=16, prompt_logprobs=2, ignore_eos=True, temperature=0)
    outs = llm.generate([a, b], params)
    assert llm.engine.scheduler.totals.num_preemptions > 0
    for ids, out in zip((a, b), outs):
        _check(tiny_llama, ids, out.prompt_logprobs, 2)
