"""The per-step draft budget (baton/engine/spec/budget.py): learned step costs, acceptance
estimates, and the goodput choice of lengths; and that the engine applies it."""
from __future__ import annotations

import pytest

from baton.engine.spec import budget as b
from baton.engine.spec.budget import Acceptance, StepCosts, choose


def test_costs_learn_plain_steps_then_ratios_first_sample_replacing_the_prior() -> None:
    c = StepCosts()
    assert c.ratio(1, 4) == pytest.approx(1 + 4 * b.PRIOR_PER_TOKEN)
    c.observe(1, 4, 0.090)  # no plain step measured yet: nothing to divide by
    assert (1, 4) not in c.ratios
    c.observe(1, 0, 0.050)
    c.observe(1, 4, 0.090)
    assert c.ratio(1, 4) == pytest.approx(1.8)
    c.observe(1, 4, 0.100)
    assert c.ratio(1, 4) == pytest.approx(1.8 + b.EWMA * (2.0 - 1.8))
    assert c.ratio(1, 0) == 1.0


def test_unmeasured_lengths_cost_at_least_a_measured_shorter_one() -> None:
    c = StepCosts()
    c.observe(1, 0, 0.05)
    c.observe(1, 2, 0.10)  # 2.0x
    assert c.ratio(1, 3) == pytest.approx(2.0)    # not the prior's 1.18
    assert c.ratio(1, 1) == pytest.approx(1 + b.PRIOR_PER_TOKEN)
    assert c.ratio(2, 3) == pytest.approx(1 + 3 * b.PRIOR_PER_TOKEN)  # another batch size


def test_large_batches_price_a_drafted_token_as_a_share_of_the_rows() -> None:
    c = StepCosts()
    rows = 8 * b.PRIOR_ROWS
    assert c.ratio(rows, 8) == pytest.approx(1 + 8 * b.PRIOR_PER_TOKEN / 8)


def test_acceptance_counts_tried_positions_and_fades_back_to_the_prior() -> None:
    a = Acceptance()
    assert a.rate("r") == pytest.approx(b.PRIOR_RATE)
    a.observe("r", 4, 1)  # positions 1 (kept) and 2 (rejected) tried
    assert a._req["r"] == [1.0, 2.0]
    assert a.rate("r") < b.PRIOR_RATE
    before = a.rate("r")
    for _ in range(200):
        a.idle("r")
        a.step(verified=False)
    assert before < a.rate("r") == pytest.approx(b.PRIOR_RATE, abs=1e-3)
    a.observe("s", 3, 3)  # all kept: three tried, and the engine-wide rate rises
    assert a._req["s"] == [3.0, 3.0] and a.rate("r") > b.PRIOR_RATE
    a.forget("r")
    assert "r" not in a._req


def _flat(ratio_per_token: float) -> StepCosts:
    c = StepCosts()
    c.observe(1, 0, 1.0)
    for d in range(1, 9):
        c.observe(1, d, 1.0 + ratio_per_token * d)
    return c


def test_choose_drafts_long_when_drafts_are_cheap_and_likely() -> None:
    assert choose(1, [(0.9, 8)], _flat(0.02)) == [8]


def test_choose_drafts_nothing_when_the_step_cost_outweighs_the_gain() -> None:
    assert choose(1, [(0.3, 8)], _flat(0.5)) == [0]


def test_choose_stops_where_goodput_peaks() -> None:
    # alpha 0.6: E(j) = 1 + .6 + .36 + .216 ...; cost 1 + 0.25 j. Goodput: j=0 1.0,
    # j=1 1.6/1.25 = 1.28, j=2 1.96/1.5 = 1.307, j=3 2.176/1.75 = 1.243 -> 2
    assert choose(1, [(0.6, 8)], _flat(0.25)) == [2]


def test_choose_gives_the_budget_to_the_likelier_row() -> None:
    c = StepCosts()
    c.observe(2, 0, 1.0)
    for d in range(1, 17):
        c.observe(2, d, 1.0 + 0.1 * d)
    got = choose(2, [(0.2, 8), (0.95, 8)], c)
    assert got[1] > 0 and got[0] == 0 and got[1] <= 8


def test_the_engine_measures_its_steps_and_cuts_drafts_that_cost_too_much(tiny_llama,
                                                                          monkeypatch):
    """Through the engine: decode steps feed StepCosts; when every drafted token is priced
    far above its gain nothing is verified (the drafter still proposes), and the outputs are
    the same tokens as without speculation; with the budget off the same drafts are verified."""
    from baton import LLM, SamplingParams
    from tests.test_spec_decode import PROMPTS

    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(spec):
        llm = LLM(str(tiny_llama), num_blocks=160, block_size=4, speculative_config=spec,
                  dtype="float32")  # fp32 named: spec on and off agree token for token
        return llm, [o.output_token_ids for o in llm.generate(PROMPTS, p)]

    _, off = run(None)
    llm, on = run({"method": "suffix"})
    assert on == off and llm.engine.spec.costs.plain_s  # decode-only steps were measured
    monkeypatch.setattr(StepCosts, "curve",
                        lambda self, rows, n: [1.0 + 100.0 * d for d in range(n + 1)])
    llm, on = run({"method": "suffix"})
    assert on == off and llm.engine.scheduler.totals.spec_drafts == 0
    llm, on = run({"method": "suffix", "step_budget": False})
    assert on == off and llm.engine.scheduler.totals.spec_accepted_tokens > 0
