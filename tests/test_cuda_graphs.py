"""The CUDA-graph decode runner's padding and static buffers (baton/engine/cuda_graphs.py), on
CPU: the step is called on the static buffers instead of replayed (capture=False), and the
model takes the attention path CUDA takes (the kernels' dispatchers, their torch references
here). Capture and replay themselves are checked on a GPU by benchmarks/gpu_check.py."""
from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.cuda_graphs import DecodeGraphs, capture_sizes
from tests.reference import hf_greedy


@pytest.mark.parametrize("max_batch, want", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64])])
def test_capture_sizes(max_batch, want):
    assert capture_sizes(max_batch) == want


def test_capture_sizes_refuses_zero():
    with pytest.raises(ValueError, match="max_batch"):
        capture_sizes(0)


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(lambda *a: None, torch.device("cpu"), 4, 4)


def _graphed_llm(folder, max_batch: int = 8) -> tuple[LLM, list[int]]:
    """An fp32 LLM on the CUDA attention path with CPU 'graphs'; the list counts each run's
    row count."""
    llm = LLM(str(folder), num_blocks=64, dtype="float32", max_num_seqs=max_batch)
    runner = llm.engine.runner
    runner.model.fused_decode = runner.model.cpu_attention = False
    graphs = DecodeGraphs(runner.decode_step, runner.device, max_batch,
                          llm.engine.max_model_len // runner.block_size + 1, capture=False)
    runs: list[int] = []
    real_run = graphs.run

    def counted(ids, *rest):
        runs.append(len(ids))
        return real_run(ids, *rest)

    graphs.run = counted
    runner.graphs = graphs
    return llm, runs


def test_graphed_decode_matches_transformers_with_padded_batches(tiny_llama):
    llm, runs = _graphed_llm(tiny_llama)
    # 3 and then fewer rows (requests end at different lengths): padded to 4 and 2
    prompts = [[5, 9, 14, 3, 7], list(range(3, 40)), [11, 12]]
    lens = [9, 6, 3]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = llm.generate(prompts, params)
    for prompt, n, out in zip(prompts, lens, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, n)
    assert 3 in runs and 1 in runs  # decode steps went through the graph runner, padded
    assert max(runs) <= 3


def test_steps_with_a_prefill_row_run_eagerly(tiny_llama):
    llm, runs = _graphed_llm(tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([[5, 9, 14, 3, 7]], params)  # one prefill step, no decode step
    assert runs == []


def test_padding_rows_write_no_kv(tiny_llama):
    llm, _ = _graphed_llm(tiny_llama)
    runner = llm.engine.runner
    kv = runner.kv_cache
    kv.normal_()
    before = kv.clone()
    bs = runner.block_size
    # 3 rows (padded to 4): sequences in blocks 5, 6-7, 9 at positions 3, 20, 0
    tables, pos = [[5], [6, 7], [9]], [3, 20, 0]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
    logits = runner.graphs.run([4, 8, 15], pos, slots, tables, [p + 1 for p in pos])
    assert logits.shape == (3, llm.engine.vocab_size)
    diff = (kv != before).any(-1).any(-1).any(2).any(1)  # [num_blocks, block_size]
    assert {tuple(x) for x in diff.nonzero().tolist()} == {(s // bs, s % bs) for s in slots}


def test_run_refuses_what_does_not_fit(tiny_llama):
    llm, _ = _graphed_llm(tiny_llama, max_batch=2)
    graphs = llm.engine.runner.graphs
    with pytest.raises(ValueError, match="rows"):
        graphs.run([1, 2, 3], [0, 0, 0], [0, 16, 32], [[0], [1], [2]], [1, 1, 1])
    with pytest.raises(ValueError, match="block table"):
        graphs.run([1], [0], [0], [list(range(graphs.max_blocks + 1))], [1])
