"""fp32 greedy outputs equal transformers' reference token for token, on every engine path."""
import random

import pytest

from baton import LLM, SamplingParams
from tests.reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check(llm: LLM, folder, prompts, params=GREEDY):
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(folder, prompt, params.max_tokens), (
            f"mismatch for prompt of {len(prompt)} tokens")
    return outs


def _pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.requests


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_single_requests_match_reference(arch, request):
    folder = request.getfixturevalue(arch)
    llm = LLM(str(folder), block_size=16, num_blocks=64, dtype="float32")
    vocab = llm.engine.model.shape.vocab_size
    for prompt in _prompts(vocab, [1, 15, 16, 17, 33]):
        _check(llm, folder, [prompt])
    _pool_whole(llm)


def test_mistral_loads_and_matches(tmp_path):
    from tests.tiny_models import build_tiny_model
    folder = build_tiny_model(tmp_path / "m", arch="mistral")
    llm = LLM(str(folder), num_blocks=32, dtype="float32")
    _check(llm, folder, _prompts(llm.engine.model.shape.vocab_size, [20]))


def test_mixed_batch_matches_reference(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=128, dtype="float32")
    prompts = _prompts(llm.engine.model.shape.vocab_size, [3, 16, 31, 48, 7, 17, 64, 1])
    _check(llm, tiny_llama, prompts)
    _pool_whole(llm)


@pytest.mark.parametrize("chunk", [1, 5, 16, 23])
def test_chunked_prefill_matches_reference(tiny_qwen3, chunk):
    llm = LLM(str(tiny_qwen3), block_size=8, num_blocks=128, long_prefill_token_threshold=chunk,
              max_num_batched_tokens=max(chunk, 8), dtype="float32")
    prompts = _prompts(llm.engine.model.shape.vocab_size, [40, 9, 25])
    _check(llm, tiny_qwen3, prompts)
    _pool_whole(llm)


def test_prefix_cache_hit_matches_reference(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64, dtype="float32")
    vocab = llm.engine.model.shape.vocab_size
    shared = _prompts(vocab, [40], seed=1)[0]
    first = shared + [5, 6, 7]
    second = shared + [9, 10, 11, 12, 13]
    (out1,) = _check(llm, tiny_llama, [first])
    assert out1.num_cached_tokens == 0
    (out2,) = _check(llm, tiny_llama, [second])
    assert out2.num_cached_tokens == 32  # two full 16-token blocks of the shared 40
    # A whole-prompt hit still computes the last token (its logits are needed).
    (out3,) = _check(llm, tiny_llama, [first[:32]])
    assert out3.num_cached_tokens == 16
    _pool_whole(llm)


def test_prefix_cache_on_equals_off(tiny_qwen2):
    prompts = _prompts(380, [30, 30, 50], seed=3)
    prompts[1] = prompts[0][:20] + prompts[1][20:]
    outs = []
    for caching in (True, False):
        llm = LLM(str(tiny_qwen2), block_size=4, num_blocks=128, enable_prefix_caching=caching,
                  dtype="float32")
        outs.append([o.output_token_ids for o in llm.generate(prompts, GREEDY)])
        outs.append([o.output_token_ids for o in llm.generate(prompts, GREEDY)])
    assert outs[0] == outs[1] == outs[2] == outs[3]


def test_preemption_under_tiny_pool_matches_reference(tiny_llama):
    # 8 requests of ~20+10 tokens need ~16 blocks of 4 each at once; the pool has 24.
    llm = LLM(str(tiny_llama), block_size=4, num_blocks=24, max_num_seqs=8, dtype="float32")
    prompts = _prompts(llm.engine.model.shape.vocab_size, [18, 20, 15, 22, 19, 17, 21, 16])
    preempted = []
    orig = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    _check(llm, tiny_llama, prompts, params)
    assert preempted, "the pool was meant to run out and force preemption"
    _pool_whole(llm)


@pytest.mark.parametrize("length", [15, 16, 17, 32])
def test_block_boundary_prompts(tiny_qwen3, length):
    llm = LLM(str(tiny_qwen3), block_size=16, num_blocks=32, dtype="float32")
    prompt = _prompts(llm.engine.model.shape.vocab_size, [length], seed=length)[0]
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)  # crosses blocks
    _check(llm, tiny_qwen3, [prompt], params)
    _pool_whole(llm)


def test_vllm_prompt_dicts(tiny_llama):
    """vLLM's TokensPrompt / TextPrompt dicts give the same outputs as bare ids and text; a dict
    with neither key and non-int ids are refused with ValueError and leave the pool whole."""
    llm = LLM(str(tiny_llama), block_size=16, num_blocks=64, dtype="float32")
    ids = _prompts(llm.engine.model.shape.vocab_size, [12])[0]
    bare = llm.generate([ids], GREEDY)[0].output_token_ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].output_token_ids == bare
    assert llm.generate([{"prompt_token_ids": ids}], GREEDY)[0].output_token_ids == bare
    text = llm.generate("hello world", GREEDY)[0].output_token_ids
    assert llm.generate([{"prompt": "hello world"}], GREEDY)[0].output_token_ids == text
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"tokens": ids}], GREEDY)
    with pytest.raises(ValueError, match="ints"):
        llm.generate([["a", "b"]], GREEDY)
    _pool_whole(llm)
