"""bf16 end to end against transformers run in bf16 on the same tiny random weights.

bf16 cannot be token-exact against fp32, nor against transformers' own bf16 (other kernels round
in other orders), so this follows vLLM's `check_logprobs_close` (tests/models/utils.py there): per
prompt, the greedy tokens agree at every position up to the first divergence; at a divergence
each side's token is in the other's top-5 at that position, and the check stops there. 24 prompts
of 1 to 60 tokens, 12 greedy tokens each, on the path a bf16 CPU model takes (torch's bf16 GEMM
for prefill; for decode the native bf16 GEMV and, without per-head q/k norms, the fused native
decode ops, scalar variants on a CPU without AVX-512F) and with torch's ops for the decode
steps' norms, rotary and SiLU instead (their attention is the native decode op either way:
`PagedAttentionPlan.decode_attention` takes it wherever `cpu_decode.use_fused` holds).
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from functools import lru_cache

import pytest
import torch

from baton import LLM, SamplingParams
from baton.closeness import check_logprobs_close
from kernels import gemv_amx
from tests.reference import hf_model

TOP = 5
NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)


def _prompts(vocab: int, count: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, 15, 16, 17, 31, 33, 60] + [rng.randrange(3, 60) for _ in range(count - 9)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@contextmanager
def _one_thread():
    """torch on one thread: on a loaded 2-core machine each 2-thread op of these tiny shapes
    waits milliseconds for its second thread, which made the reference take minutes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def hf_bf16_greedy(folder, prompt: list[int], max_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers in bf16, greedy, with its own KV cache: (tokens, top-5 ids at each step)."""
    model = hf_model(str(folder), torch.bfloat16)
    tokens, tops = [], []
    with _one_thread():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            logits = out.logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            tops.append(set(logits.topk(TOP).indices.tolist()))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens, tops


@lru_cache(maxsize=4)
def _reference(folder) -> list:
    vocab = hf_model(str(folder), torch.bfloat16).config.vocab_size
    return [hf_bf16_greedy(folder, p, NEW_TOKENS) for p in _prompts(vocab)]


def _baton(llm: LLM) -> list:
    prompts = _prompts(llm.engine.model.shape.vocab_size)
    outs = llm.generate(prompts, PARAMS)
    return [(o.output_token_ids, [set(lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("arch,fused,gemm,gemv", [
    ("tiny_llama", False, "bf16", ""), ("tiny_llama", True, "bf16", ""),
    ("tiny_llama", True, "fp32", ""), ("tiny_qwen2", False, "bf16", ""),
    ("tiny_qwen2", True, "bf16", ""), ("tiny_qwen3", False, "bf16", ""),
    ("tiny_llama_d32", True, "bf16", ""), ("tiny_llama", True, "bf16", "avx512"),
    ("tiny_llama_d32", True, "bf16", "avx512")])
def test_bf16_logprobs_close_to_transformers_bf16(arch, fused, gemm, gemv, request, monkeypatch):
    """gemm: the prompt GEMMs in bf16 or in fp32 (baton/models/linear.py bf16_gemm_in_fp32:
    the choice on CPUs whose bf16 products are slow), forced either way. gemv: the decode
    GEMV the machine picks ("": AMX where it runs) or the AVX512_BF16 one, forced."""
    monkeypatch.setenv("BATON_BF16_GEMM", gemm)
    monkeypatch.setenv("BATON_BF16_GEMV", gemv)
    folder = request.getfixturevalue(arch)
    llm = LLM(str(folder), dtype="bfloat16", block_size=16, num_blocks=128)
    model = llm.engine.model
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert model.native_gemv, "a bf16 CPU model must store its matrices for the native GEMV"
    assert model.fused_decode == (arch != "tiny_qwen3")  # the default: native ops where they fit
    model.fused_decode = fused  # on: the native bf16 ops read the bf16 cache in place
    assert model.gemm_fp32 == (gemm == "fp32")
    assert model.amx_gemv == (gemv == "" and gemv_amx.available())
    exact = check_logprobs_close(_baton(llm), _reference(folder), "baton", "transformers")
    # not vacuous: on these peaked random models most prompts agree on all 12 tokens
    assert exact >= len(_prompts(model.shape.vocab_size)) // 2, f"only {exact} prompts agree fully"


def test_the_rule_catches_a_wrong_token():
    """A divergence to a token outside the other side's top-5 fails; inside it, it passes."""
    ref = [([1] * NEW_TOKENS, [{1, 2, 3, 4, 5}] * NEW_TOKENS)]
    near = [([1, 2] + [9] * (NEW_TOKENS - 2), [{1, 2, 3, 4, 5}] * NEW_TOKENS)]
    far = [([1, 7] + [1] * (NEW_TOKENS - 2), [{1, 7, 3, 4, 5}] * NEW_TOKENS)]
    assert check_logprobs_close(near, ref, "a", "b") == 0
    with pytest.raises(AssertionError, match="position 1"):
        check_logprobs_close(far, ref, "a", "b")


def _step(model, kv, rows, block_size: int):
    """One decode-only step over `rows` = [(token, position, block table)] → logits [B, V]."""
    from baton.models.decoder import AttentionMetadata

    width = max(len(t) for _, _, t in rows)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[p // block_size] * block_size + p % block_size
                                   for _, p, t in rows]),
        num_decode_tokens=len(rows),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in rows],
                                         dtype=torch.int32),
        decode_context_lens=torch.tensor([p + 1 for _, p, _ in rows], dtype=torch.int32))
    ids, pos = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    return model.compute_logits(model.forward(ids, pos, meta, kv))


def test_bf16_decode_step_is_batch_invariant(tiny_llama):
    """A sequence's logits in a decode-only step are the same bits alone or beside others: the
    bf16 model takes the fused native step on every CPU (kernels.cpu_decode.use_fused), whose
    GEMV sums in one fixed order and whose attention runs per sequence. (The torch step is not:
    its batched SDPA over contexts padded to the longest changes a row's bits.)"""
    llm = LLM(str(tiny_llama), dtype="bfloat16", block_size=16, num_blocks=64)
    model = llm.engine.model
    assert model.fused_decode
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(64, *llm.engine.runner.kv_cache.shape[1:], generator=g) * 0.5).bfloat16()
    lens = [1, 17, 40, 33, 5, 64, 16, 9]  # cached context; the new token sits at position len
    firsts = [sum(1 + m // 16 for m in lens[:i]) for i in range(len(lens))]  # distinct blocks
    tables = [list(range(f, f + 1 + n // 16)) for f, n in zip(firsts, lens)]
    rows = [(3 + 11 * i, n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    together = _step(model, kv.clone(), rows, 16)
    for i, row in enumerate(rows):
        assert torch.equal(_step(model, kv.clone(), [row], 16)[0], together[i]), f"row {i}"
    assert torch.equal(_step(model, kv.clone(), rows[2:5], 16), together[2:5])


def test_decode_row_beside_a_prefill_gets_its_decode_only_bits(tiny_qwen2):
    """A bf16 decode row in a step that also prefills another sequence gets the logits it gets
    in a decode-only step, bit for bit, while the step stays within the native GEMV's rows (32
    here): its attention is the same native op either way (torch's batched SDPA was another
    summation order), norms, SiLU and rotary the same roundings. (A bigger step's GEMMs are
    oneDNN's, another order; fp32 steps above 16 rows too.)"""
    from baton.models.decoder import AttentionMetadata

    llm = LLM(str(tiny_qwen2), dtype="bfloat16", block_size=16, num_blocks=64)
    model = llm.engine.model
    assert model.fused_decode
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(64, *llm.engine.runner.kv_cache.shape[1:], generator=g) * 0.5).bfloat16()
    rows = [(7, 40, [0, 1, 2]), (9, 17, [3, 4])]  # (token, position, block table)
    alone = _step(model, kv.clone(), rows, 16)
    n = 30  # a prompt chunk of another sequence in blocks 10, 11
    tables = torch.tensor([t + [0] * (3 - len(t)) for _, _, t in rows], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[p // 16] * 16 + p % 16 for _, p, t in rows]
                                  + list(range(160, 160 + n))),
        num_decode_tokens=len(rows), decode_block_tables=tables,
        decode_context_lens=torch.tensor([p + 1 for _, p, _ in rows], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[10, 11]], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32))
    ids = torch.tensor([r[0] for r in rows] + list(range(3, 3 + n)))
    pos = torch.tensor([r[1] for r in rows] + list(range(n)))
    mixed = model.compute_logits(model.forward(ids, pos, meta, kv.clone()))
    assert torch.equal(mixed[:len(rows)], alone)
