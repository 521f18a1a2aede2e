"""The sampling rule of speculative rows (baton/engine/spec/verify.py) checked statistically:
a position's token follows the target distribution exactly (chi-square against the exact
probabilities, and on a tiny model against the same run without speculation), with a
control that a wrong rule fails the same bound. Fixed seeds: every run draws the same
numbers, so nothing here is flaky."""
from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.sampler import Sampler, make_generator
from baton.engine.spec.verify import Verifier, VerifyRow

# chi-square critical values at p = 0.001 (degrees of freedom → value)
CHI2_999 = {4: 18.47, 9: 27.88}
P0 = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
P1 = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])
P2 = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5])
DRAFTS = (0, 2)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def _verify(n: int, params: SamplingParams, generators=None, verifier=None):
    logits = torch.stack([P0.log(), P1.log(), P2.log()]).repeat(n, 1)
    rows = [VerifyRow(params, g, None, None, DRAFTS) for g in (generators or [None] * n)]
    out = (verifier or Verifier())(logits, rows)
    return out.token_ids.split(list(out.row_lengths))


def test_each_position_follows_the_target_distribution():
    torch.manual_seed(0)
    rows = _verify(6000, SamplingParams(temperature=1.0))
    first = torch.bincount(torch.stack([r[0] for r in rows]), minlength=5)
    second = torch.bincount(torch.stack([r[1] for r in rows if len(r) > 1]), minlength=5)
    third = torch.bincount(torch.stack([r[2] for r in rows if len(r) > 2]), minlength=5)
    assert _chi2(first, P0) < CHI2_999[4]
    assert _chi2(second, P1) < CHI2_999[4]  # given draft 0 kept: p(· | x d1)
    assert _chi2(third, P2) < CHI2_999[4]
    assert int(second.sum()) == int(first[DRAFTS[0]])  # position 1 only after a kept draft
    assert all(len(r) == 1 or r[0] == DRAFTS[0] for r in rows)
    # control: keeping every draft (a wrong rule) is far outside the bound
    forced = _verify(6000, SamplingParams(temperature=1.0), verifier=Verifier((1.0, 1.0)))
    assert _chi2(torch.bincount(torch.stack([r[0] for r in forced]), minlength=5), P0) > 1000


def test_seeded_rows_draw_once_per_output_position():
    """A seeded row's tokens are those a plain sampler gives with the same generator, one
    call per output position (a rejected position draws nothing)."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    rows = _verify(200, params, [make_generator(s) for s in range(200)])
    sampler = Sampler()
    for seed, tokens in enumerate(rows):
        g = make_generator(seed)
        for j, p in enumerate((P0, P1, P2)[:len(tokens)]):
            assert int(sampler(p.log()[None], [params], [g]).token_ids) == int(tokens[j])
        assert len(tokens) == 3 or int(tokens[-1]) != DRAFTS[len(tokens) - 1]


@pytest.fixture(scope="module")
def peaked_llama(tmp_path_factory):
    """A tiny random Llama whose lm_head is scaled 8×: sampling at temperature 1 is peaked
    enough that its outputs repeat and drafts get accepted, yet spread over many tokens."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import build_tiny_model
    folder = build_tiny_model(tmp_path_factory.mktemp("peaked_llama"), arch="llama")
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    total = a + b
    keep = total > 0
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    return float((((a - ea) ** 2 / ea) + ((b - eb) ** 2 / eb))[keep].sum())


def test_tiny_model_distribution_with_and_without_speculation(peaked_llama):
    """Unseeded sampling at temperature 1 on a prompt whose continuation repeats: the
    empirical distribution of the 4th output token with speculation matches the one without
    (two-sample chi-square over the 9 most frequent tokens + the rest); keeping every draft
    (a wrong rule) does not."""
    base = [5, 6] + list(range(50, 70))
    greedy = LLM(str(peaked_llama), num_blocks=64, block_size=4).generate(
        [base], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    prompt = base + greedy.output_token_ids
    p = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = {}
    # every draft verified (no step budget): the rule under test must see many drafts
    for name, spec in (("off", None), ("on", {"method": "suffix", "step_budget": False}),
                       ("wrong", {"method": "suffix", "synthetic_acceptance": (1.0,)})):
        llm = LLM(str(peaked_llama), num_blocks=1200, block_size=4, seed=1,
                  speculative_config=spec)
        runs[name] = torch.tensor([o.output_token_ids[3] for o in llm.generate([prompt] * 600, p)])
        if name == "on":
            assert llm.engine.scheduler.totals.spec_accepted_tokens > 300
    top = torch.bincount(runs["off"]).argsort(descending=True)[:9].tolist()

    def binned(tokens):
        counts = [int((tokens == t).sum()) for t in top]
        return torch.tensor(counts + [len(tokens) - sum(counts)], dtype=torch.float64)

    off = binned(runs["off"])
    assert off.max() < 0.7 * off.sum()  # not a near-deterministic token: the test can see
    assert _two_sample_chi2(off, binned(runs["on"])) < CHI2_999[9]
    assert _two_sample_chi2(off, binned(runs["wrong"])) > CHI2_999[9]
