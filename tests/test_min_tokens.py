"""min_tokens as vLLM defines it: eos and stop_token_ids cannot be sampled (logit -inf)
before a request has generated min_tokens tokens, so the model writes on instead of ending
its turn early (ignoring a sampled eos would let the model run on past its own end of turn)."""
from __future__ import annotations

import torch

from baton import LLM, SamplingParams
from baton.engine.sampler import Sampler


def test_banned_ids_are_never_sampled_and_other_rows_are_untouched():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    out = Sampler()(logits, params, [None, None], banned=[frozenset({4, 7}), frozenset()])
    assert out.token_ids.tolist()[1] == 4 and out.token_ids.tolist()[0] not in (4, 7)
    sampled = Sampler()(logits, [SamplingParams(temperature=1.0, seed=3)] * 2,
                        [torch.Generator().manual_seed(s) for s in (1, 2)],
                        banned=[frozenset({4}), frozenset({4})])
    assert 4 not in sampled.token_ids.tolist()
    # logprobs stay those of the raw logits
    torch.testing.assert_close(out.logprobs[1], torch.log_softmax(logits[1], -1)[4])


def test_eos_and_stop_token_ids_wait_for_min_tokens_through_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64, dtype="float32")
    (eos,) = sorted(llm.engine.eos_token_ids)[:1]
    prompt = [[5, 6, 7, 8]]
    eager = SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: 100.0})
    assert llm.generate(prompt, eager)[0].output_token_ids == [eos]  # it wants to end at once
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=5,
                                              logit_bias={eos: 100.0}))[0]
    assert out.finish_reason == "stop" and eos not in out.output_token_ids[:5]
    assert out.output_token_ids[5:] == [eos]
    stop_id = 9 if eos != 9 else 10
    out = llm.generate(prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=12,
                                              min_tokens=3, stop_token_ids=[stop_id],
                                              logit_bias={stop_id: 100.0}))[0]
    assert out.output_token_ids[:3].count(stop_id) == 0 and out.output_token_ids[3:] == [stop_id]
    # ignore_eos: eos may be sampled (and is not a stop), as without min_tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, min_tokens=2,
                                              ignore_eos=True, logit_bias={eos: 100.0}))[0]
    assert out.output_token_ids == [eos] * 4
