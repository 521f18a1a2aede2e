"""The P/D cost model on constructed queue states (baton/pd_cost.py), and the decode
worker's learned rates (decode_service/pd_rates.py)."""
from __future__ import annotations

import pytest

from baton.pd_cost import (PRIOR_PREFILL_TOKENS_PER_S, PDPolicy, PDRates, PDState, decide,
                           shared_remote_s)
from decode_service.pd_rates import PDEstimator

RATES = PDRates(local_tokens_per_s=2000.0, remote_tokens_per_s=2000.0,
                transfer_bytes_per_s=1e9)
POLICY = PDPolicy(itl_budget_s=0.05)
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4  # a 135M-model block of 16 tokens, float32


def state(prompt: int, cached: int = 0, running: int = 0, decode_queue: int = 0,
          prefill_queue: int = 0) -> PDState:
    return PDState(prompt, cached, running, decode_queue, prefill_queue, 16, BLOCK_BYTES)


def test_short_continuation_with_long_prefill_queue_goes_local():
    d = decide(state(4096, cached=4032, running=8, prefill_queue=30_000), RATES, POLICY)
    assert (d.path, d.reason) == ("local", "faster_local")
    assert d.stall_s == pytest.approx(64 / 2000)
    assert d.remote_s > 15.0


def test_long_cold_prompt_with_idle_prefill_goes_remote():
    busy = decide(state(2048, running=8), RATES, POLICY)
    assert (busy.path, busy.reason) == ("remote", "itl_budget")
    idle = decide(state(2048), RATES, POLICY)  # decode idle too: still remote
    assert (idle.path, idle.reason) == ("remote", "long_prompt")


def test_a_continuation_past_the_itl_budget_goes_local_while_decode_runs_nothing():
    """200 uncached tokens: a 0.1 s stall, past the 50 ms ITL budget. With sequences running
    it goes remote; with none (the idle budget, 0.25 s) it takes the faster path, here
    local (no transfer); with the idle budget off it goes remote as a long prompt."""
    cont = state(1000, cached=800)
    assert decide(state(1000, cached=800, running=3), RATES, POLICY).reason == "itl_budget"
    d = decide(cont, RATES, POLICY)
    assert (d.path, d.reason) == ("local", "idle_faster_local")
    assert d.stall_s == pytest.approx(0.1)
    off = PDPolicy(itl_budget_s=0.05, idle_budget_s=0.0)
    assert (decide(cont, RATES, off).path, decide(cont, RATES, off).reason) == (
        "remote", "long_prompt")
    queued = decide(state(1000, cached=800, decode_queue=4000), RATES, POLICY)
    assert (queued.path, queued.reason) == ("remote", "idle_faster_remote")
    cold = decide(state(1000), RATES, POLICY)  # 0.5 s: past the idle budget
    assert (cold.path, cold.reason) == ("remote", "long_prompt")


def test_long_prompt_saturated_prefill_idle_decode_goes_local():
    d = decide(state(2048, prefill_queue=20_000), RATES, POLICY)
    assert (d.path, d.reason) == ("local", "prefill_saturated")
    assert d.remote_s - d.local_s > d.stall_s


def test_itl_budget_exceeded_while_decode_busy_goes_remote_even_if_slower():
    d = decide(state(2048, running=1, prefill_queue=20_000), RATES, POLICY)
    assert (d.path, d.reason) == ("remote", "itl_budget")
    assert d.remote_s > d.local_s


def test_short_prompt_behind_a_long_local_queue_goes_remote():
    d = decide(state(64, decode_queue=10_000), RATES, POLICY)
    assert (d.path, d.reason) == ("remote", "faster_remote")


def test_fully_cached_prompt_stays_local():
    assert decide(state(64, cached=64), RATES, POLICY).reason == "cached"


@pytest.mark.parametrize("uncached,remote", [(15, False), (16, True), (3000, True)])
def test_min_remote_tokens_overrides_the_estimate(uncached, remote):
    policy = PDPolicy(min_remote_tokens=16)
    d = decide(state(4096, cached=4096 - uncached, prefill_queue=10**6), RATES, policy)
    assert (d.remote, d.reason) == (remote, "threshold")


def test_transfer_cost_counts_blocks_written_and_decodes_hit_read_back():
    """The remote path writes the blocks decode lacks and, at worst, reads every block of
    decode's hit (the prefill worker reads what it lacks instead of recomputing it): a
    warm prompt moves as many blocks as a cold one, and computes only its uncached part."""
    slow_link = PDRates(2000.0, 2000.0, transfer_bytes_per_s=1e6)
    cold = decide(state(64), slow_link, POLICY)
    warm = decide(state(64, cached=32), slow_link, POLICY)
    assert cold.remote_s - warm.remote_s == pytest.approx(32 / 2000, rel=1e-6)
    assert cold.remote_s == pytest.approx(64 / 2000 + 4 * BLOCK_BYTES / 1e6 + 0.005)


def test_estimator_learns_with_an_ewma_and_ignores_tiny_samples():
    est = PDEstimator()
    est.observe_local(8, 1.0)  # too short to measure a rate
    assert est.rates("p:1").local_tokens_per_s == PRIOR_PREFILL_TOKENS_PER_S
    for _ in range(60):
        est.observe_local(500, 1.0)
        est.observe_remote("p:1", 7, 1000, 0.1)
        est.observe_transfer("p:1", 7, 10**8, 0.5)
    r = est.rates("p:1")
    assert r.local_tokens_per_s == pytest.approx(500, rel=1e-3)
    assert r.remote_tokens_per_s == pytest.approx(10_000, rel=1e-3)
    assert r.transfer_bytes_per_s == pytest.approx(2e8, rel=1e-3)


def test_flags_default_to_the_decider_and_keep_the_threshold():
    from decode_service.config import parse_args
    assert parse_args([]).min_remote_tokens is None
    assert parse_args([]).local_prefill_itl_budget_ms == 50.0
    assert parse_args([]).local_prefill_idle_budget_ms == 250.0
    assert parse_args(["--local-prefill-idle-budget-ms", "0"]).local_prefill_idle_budget_ms == 0
    cfg = parse_args(["--min-remote-tokens", "64", "--local-prefill-itl-budget-ms", "20"])
    assert (cfg.min_remote_tokens, cfg.local_prefill_itl_budget_ms) == (64, 20.0)


def test_on_shared_cores_a_busy_decode_takes_the_faster_path():
    """Remote prefill on decode's own cores (`--pin share`) slows the batch too: past the
    ITL budget on both paths, the request is not made to wait for a protection the batch
    does not get. Both paths are priced at the higher measured rate (the same cores), the
    remote one at its share of them beside a busy decode (the rates of a 2-vCPU EPYC: 590
    tokens/s on two threads, 330 on one)."""
    cpu = PDRates(local_tokens_per_s=590.0, remote_tokens_per_s=330.0, transfer_bytes_per_s=1e9)
    shared = PDPolicy(itl_budget_s=0.05, remote_stall_fraction=0.5)
    d = decide(state(1000, cached=700, running=3), cpu, shared)
    assert (d.path, d.reason) == ("local", "shared_faster_local")
    assert d.local_s < d.remote_s
    # own cores (fraction 0): the batch is protected, as before
    own = decide(state(1000, cached=700, running=3), cpu, POLICY)
    assert (own.path, own.reason) == ("remote", "itl_budget")
    # a long local queue does not make the remote path faster on shared cores: the queue
    # runs meanwhile at decode's share of the same cores, and the remote first token comes
    # from a decode step after it (pd_cost.shared_remote_s)
    queued = decide(state(1000, cached=700, running=3, decode_queue=3000), cpu, shared)
    assert (queued.path, queued.reason) == ("local", "shared_faster_local")
    assert queued.remote_s >= (3000 / 590) / 0.5
    # on the prefill worker's own cores the same queue sends it remote (ITL budget)
    assert decide(state(1000, cached=700, running=3, decode_queue=3000), cpu, POLICY).remote
    # a remote prefill that takes less of the cores (a quarter: 160 tokens stall the batch
    # 80 ms here, 27 ms there) stays inside the budget and still protects the batch
    quarter = PDPolicy(itl_budget_s=0.05, remote_stall_fraction=0.25)
    small = decide(state(1000, cached=840, running=3), RATES, quarter)
    assert (small.path, small.reason) == ("remote", "itl_budget")
    assert small.remote_s == pytest.approx(160 / 1500 + 0.005 + 63 * BLOCK_BYTES / 1e9)


def test_on_shared_cores_an_idle_decode_keeps_a_long_prompt_unless_remote_is_faster():
    """Decode idle, a cold prompt past the idle budget: on its own cores the prefill worker
    takes it ("long_prompt"); on shared ones a remote prefill would slow whatever starts
    decoding meanwhile just as much, so the faster path (local: no transfer) wins."""
    shared = PDPolicy(itl_budget_s=0.05, remote_stall_fraction=0.5)
    d = decide(state(2048), RATES, shared)
    assert (d.path, d.reason) == ("local", "shared_faster_local")
    assert decide(state(2048), RATES, POLICY).reason == "long_prompt"
    # also where the remote side's stall is within the idle budget (0.5 × 800 / 2000 = 0.2 s
    # ≤ 0.25 s): it went remote as "long_prompt", and a cold 900-token prompt then took 8 %
    # longer to its first token than kept local, 18 of 20 alternated (BENCHMARKS.md, stop 37)
    d = decide(state(800), RATES, shared)
    assert (d.path, d.reason) == ("local", "shared_faster_local")
    assert decide(state(800), RATES, POLICY).reason == "long_prompt"


def test_shared_cores_price_the_remote_first_token_behind_decodes_queue():
    """The burst of stop 36 (BENCHMARKS.md): a ~100-token continuation turn behind two
    others queued on decode (0.148 s of work at all the cores), remote_stall_fraction 0.47:
    its remote compute (0.156 s at the share it gets) used to beat local (0.23 s), and the
    local two then ran at half the cores; priced behind decode's queue at decode's share
    (0.148 / 0.53 = 0.28 s) it stays local. Own cores (fraction 0) or no queue: unchanged."""
    p = PDPolicy(itl_budget_s=0.05, remote_stall_fraction=0.47)
    assert shared_remote_s(0.156, 0.148, p) == pytest.approx(0.148 / 0.53)
    assert shared_remote_s(0.156, 0.0, p) == 0.156
    assert shared_remote_s(0.156, 0.148, PDPolicy()) == 0.156
    assert shared_remote_s(0.5, 0.148, p) == 0.5


def test_on_shared_cores_decodes_queued_prefill_makes_it_busy():
    """Nothing running on decode yet, but a prompt queued there (the first turn of a burst):
    its prefill steps keep decode's share of the shared cores, so a remote prefill beside them
    is priced at the rest, as beside running sequences: the second turn of the burst stays
    local (it went remote as "idle_faster_remote" when an idle decode's rate was assumed)."""
    shared = PDPolicy(itl_budget_s=0.05, remote_stall_fraction=0.5)
    rates = PDRates(local_tokens_per_s=1300.0, remote_tokens_per_s=1300.0)
    d = decide(state(500, cached=400, running=0, decode_queue=60), rates, shared)
    assert not d.remote
    assert d.remote_s >= 100 / 650
