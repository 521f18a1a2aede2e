"""Sampler: greedy, filtering, distribution, per-request seeds, logprobs."""
import pytest
import torch

from baton.engine.sampler import Sampler, SamplerOutput, apply_top_k_top_p, make_generator
from baton.sampling_params import SamplingParams

sampler = Sampler()
# Probabilities 0.5, 0.3, 0.1, 0.05, 0.05 (exactly, up to float rounding).
PROBS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
LOGITS = PROBS.log()


def _draws(params: SamplingParams, n: int = 4000, logits=LOGITS, seed: int = 0) -> torch.Tensor:
    """n independent samples: one batch of n identical rows, default RNG seeded."""
    torch.manual_seed(seed)
    out = sampler(logits.expand(n, -1).clone(), [params] * n, [None] * n)
    return out.token_ids


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_output_types_and_shapes():
    out = sampler(torch.randn(3, 50), [SamplingParams()] * 3, [None] * 3)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.int64
    assert out.logprobs.shape == (3,) and out.logprobs.dtype == torch.float32
    assert out.top_logprobs is None


def test_greedy_is_argmax():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    out = sampler(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 16
    gens = [make_generator(i) if i % 2 else None for i in range(16)]
    out = sampler(logits, params, gens)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.9) for i in range(6)]
    out = sampler(logits, params, [None] * 6)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),
    (SamplingParams(top_p=0.85), {0, 1, 2}),
    (SamplingParams(top_p=0.3), {0}),
    (SamplingParams(min_p=0.15), {0, 1, 2}),
    (SamplingParams(min_p=0.7), {0}),
    (SamplingParams(top_k=3, top_p=0.7), {0, 1}),
    (SamplingParams(top_k=4, min_p=0.25), {0, 1}),
])
def test_filters_sample_only_from_the_allowed_set(params, allowed):
    seen = set(_draws(params).tolist())
    assert seen == allowed  # never outside, and every allowed token shows up


def test_filtered_distribution_is_renormalized():
    tokens = _draws(SamplingParams(top_p=0.7), n=20000)
    assert set(tokens.tolist()) == {0, 1}
    # 1 degree of freedom: P(chi2 > 15) ~ 1e-4.
    assert _chi_square(tokens, torch.tensor([0.625, 0.375])) < 15.0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    expected = (logits / temperature).softmax(-1)
    tokens = _draws(SamplingParams(temperature=temperature), n=20000, logits=logits)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4; the seed is fixed so this is not flaky.
    assert _chi_square(tokens, expected) < 25.0


def test_seeded_generator_draws_follow_the_distribution():
    g = make_generator(1234)
    p = SamplingParams(temperature=0.8, seed=1234)
    tokens = torch.cat([sampler(LOGITS[None], [p], [g]).token_ids for _ in range(2000)])
    assert _chi_square(tokens, (LOGITS / 0.8).softmax(-1)) < 25.0


def _run_seeded(position: int, batch: int, steps_logits, others) -> list[int]:
    """Tokens of the seed-42 row placed at `position` in a batch of `batch` rows."""
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    gen = make_generator(42)
    other_gens = [make_generator(1000 + i) if seeded else None for i, (_, seeded)
                  in enumerate(others)]
    tokens = []
    for step_logits in steps_logits:
        rows, params, gens, j = [], [], [], 0
        for r in range(batch):
            if r == position:
                rows.append(step_logits)
                params.append(mine)
                gens.append(gen)
            else:
                rows.append(torch.randn(step_logits.shape[0]) * 3)
                params.append(others[j][0])
                gens.append(other_gens[j])
                j += 1
        out = sampler(torch.stack(rows), params, gens)
        tokens.append(int(out.token_ids[position]))
    return tokens


def test_seed_gives_same_tokens_whatever_the_batch():
    steps = [torch.randn(500, generator=torch.Generator().manual_seed(s)) for s in range(20)]
    others = [
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.7, top_k=50, seed=7), True),
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=1.3, min_p=0.05), False),
        (SamplingParams(temperature=1.0, seed=9), True),
    ]
    torch.manual_seed(0)
    alone = _run_seeded(0, 1, steps, [])
    assert len(set(alone)) > 10  # really sampling, not collapsing to argmax
    for position, batch, seed in [(0, 6, 1), (3, 6, 2), (5, 6, 3), (2, 4, 4)]:
        torch.manual_seed(seed)  # the default RNG state must not matter either
        assert _run_seeded(position, batch, steps, others[:batch - 1]) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=43)
    gen43 = make_generator(43)
    different = [int(sampler(s[None], [other_seed], [gen43]).token_ids[0]) for s in steps]
    assert different != alone


def test_unseeded_rows_use_the_default_rng():
    logits = torch.randn(4, 100)
    params = [SamplingParams()] * 4
    torch.manual_seed(5)
    a = sampler(logits, params, [None] * 4).token_ids
    torch.manual_seed(5)
    b = sampler(logits, params, [None] * 4).token_ids
    assert torch.equal(a, b)


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(5, 200, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.5, logprobs=k) for k in (None, 0, 3, 20, 7)]
    out = sampler(logits, params, [None] * 5)
    ref = logits.log_softmax(-1)
    chosen = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, chosen, atol=1e-5)
    ids, lps = out.top_logprobs
    assert ids.shape == lps.shape == (5, 20)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32
    assert torch.allclose(lps, ref.gather(1, ids), atol=1e-5)
    assert bool((lps[:, :-1] >= lps[:, 1:]).all())
    assert torch.allclose(lps, ref.topk(20, dim=-1).values, atol=1e-5)


def test_logprobs_zero_gives_empty_top_and_none_gives_none():
    logits = torch.randn(2, 30)
    out = sampler(logits, [SamplingParams(logprobs=0)] * 2, [None] * 2)
    assert out.top_logprobs[0].shape == (2, 0)
    assert sampler(logits, [SamplingParams()] * 2, [None] * 2).top_logprobs is None


def test_top_k_top_p_keeps_ties_and_the_top_token():
    logits = torch.tensor([[3.0, 3.0, 1.0, 0.0], [10.0, 0.0, 0.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1, 4]), torch.tensor([1.0, 1e-6]))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()
    assert torch.isfinite(out[1, 0]) and torch.isinf(out[1, 1:]).all()


def test_rank_of_the_sampled_token_in_the_raw_distribution():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(9)) * 3
    params = [SamplingParams(temperature=1.5, logprobs=1)] * 5 + [SamplingParams(logprobs=1)]
    gens = [make_generator(s) for s in range(6)]
    out = sampler(logits, params, gens)
    order = logits.argsort(dim=-1, descending=True)  # no ties among random floats
    expected = (order == out.token_ids[:, None]).nonzero()[:, 1] + 1
    assert torch.equal(out.ranks, expected)
    assert out.ranks[5] == 1  # greedy row: the most likely token
    assert sampler(logits, [SamplingParams()] * 6, [None] * 6).ranks is None
