"""Logit bias and penalties against vLLM's formulation (re-implemented here, vectorized over
the batch as vllm/model_executor/layers/utils.py::apply_penalties does), and their effect
through the Sampler and the engine."""
import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.penalties import apply_logit_processing
from baton.engine.sampler import Sampler


def vllm_apply_penalties(logits, prompt_mask, output_bin_counts, presence, frequency,
                         repetition):
    """vLLM's batched formula: masks [B, V], per-row penalties [B]."""
    logits = logits.clone()
    output_mask = output_bin_counts > 0
    rep = repetition.unsqueeze(1).repeat(1, logits.shape[1])
    factor = torch.where(prompt_mask | output_mask, rep, torch.ones_like(rep))
    pos = logits > 0
    logits[pos] /= factor[pos]
    logits[~pos] *= factor[~pos]
    logits -= frequency.unsqueeze(1) * output_bin_counts
    logits -= presence.unsqueeze(1) * output_mask
    return logits


def _batch(seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=g) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9]]
    outputs = [[3, 10, 10, 11], [], [6, 6, 6], [12]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.3),
              SamplingParams(),  # nothing to apply: must stay bit-identical
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
              SamplingParams(repetition_penalty=0.7)]
    return logits, prompts, outputs, params


def test_penalties_equal_vllms_formula_and_leave_other_rows_untouched():
    logits, prompts, outputs, params = _batch()
    vocab = logits.shape[1]
    prompt_mask = torch.zeros(4, vocab, dtype=torch.bool)
    counts = torch.zeros(4, vocab)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        prompt_mask[i, p] = True
        for t in o:
            counts[i, t] += 1
    expected = vllm_apply_penalties(
        logits, prompt_mask, counts, torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]))
    got = apply_logit_processing(logits, params, list(zip(prompts, outputs)))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_logit_bias_is_added_and_can_force_or_ban_a_token():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, logit_bias={4: -100.0, 2: 0.5})]
    out = Sampler()(logits, params, [None, None])
    assert out.token_ids.tolist() == [7, 2]
    # logprobs stay those of the raw logits (vLLM's default raw_logprobs)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw[[0, 1], [7, 2]])


def test_greedy_token_is_the_argmax_of_the_penalized_logits():
    logits, prompts, outputs, params = _batch(seed=3)
    params = [SamplingParams(temperature=0, presence_penalty=p.presence_penalty,
                             frequency_penalty=p.frequency_penalty,
                             repetition_penalty=p.repetition_penalty) for p in params]
    history = list(zip(prompts, outputs))
    out = Sampler()(logits, params, [None] * 4, history)
    assert out.token_ids.tolist() == \
        apply_logit_processing(logits, params, history).argmax(-1).tolist()


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
                                 dict(logit_bias={3: 101.0}), dict(logit_bias={-1: 1.0}),
                                 dict(presence_penalty=float("nan"))])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_repetition_penalty_changes_greedy_output_through_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64, dtype="float32")
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8]]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True))[0].output_token_ids
    strong = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=100.0, frequency_penalty=2.0)
    penalized = llm.generate(prompt, strong)[0].output_token_ids
    assert penalized != plain
    assert len(set(penalized)) == len(penalized)  # every repeat was pushed below the rest
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1.0}))
