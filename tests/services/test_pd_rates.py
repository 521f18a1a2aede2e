"""The P/D decider's learned rates take only samples that are rates (issue 27): never a
non-positive or non-finite one (a cost model fed a negative rate prices a path below free),
an outlier 100x off only when three in a row say the rate moved, and a prefill peer's new
process (kv_epoch) starts again from the priors."""
from __future__ import annotations

import math
import time

import pytest

from baton.pd_cost import PRIOR_PREFILL_TOKENS_PER_S, PRIOR_TRANSFER_BYTES_PER_S
from decode_service.metrics import DecodeMetrics
from decode_service.pd_choice import SENT_MAX_AGE_S, PDChooser
from decode_service.pd_rates import OUTLIER_FACTOR, Ewma, PDEstimator
from decode_service.peers import PeerLoad, PrefillPeer, PrefillPeers
from protos import common_pb2, prefill_pb2


@pytest.mark.parametrize("x", [-428.0, 0.0, -0.0, math.nan, math.inf, -math.inf])
def test_a_sample_that_is_no_rate_is_rejected(x):
    e = Ewma(1000.0)
    assert e.add(x) is False
    assert e.value == 1000.0 and e.samples == 0 and e.rejected == 1


def test_the_first_sample_is_taken_however_far_from_the_prior():
    e = Ewma(2000.0)
    assert e.add(2000.0 * OUTLIER_FACTOR * 5)  # the prior is a guess, not a measurement
    assert e.samples == 1 and e.value == 1e6  # it replaces the prior
    assert e.add(5e5) and e.value == pytest.approx(1e6 + 0.2 * (5e5 - 1e6))  # then the EWMA


def test_an_outlier_is_held_back_until_three_in_a_row_say_the_rate_moved():
    e = Ewma(1000.0)
    e.add(1000.0)
    assert not e.add(1000.0 * OUTLIER_FACTOR * 2)  # one absurd sample: value untouched
    assert e.value == 1000.0
    assert e.add(1500.0)  # a plausible one clears the run
    assert not e.add(1e7) and not e.add(2e7)
    assert e.value == pytest.approx(1100.0)
    assert e.add(3e7)  # a third in a row on the same side: the rate really moved
    assert e.value == 2e7 and e.rejected == 3


def test_outliers_on_both_sides_are_noise_not_a_move():
    e = Ewma(1000.0)
    e.add(1000.0)
    for x in (1e6, 1e-3, 1e6, 1e-3, 1e6):
        assert not e.add(x)
    assert e.value == 1000.0 and e.rejected == 5


def test_boundaries_are_taken():
    e = Ewma(1000.0, alpha=0.0)
    e.add(1000.0)
    assert e.add(1000.0 * OUTLIER_FACTOR) and e.add(1000.0 / OUTLIER_FACTOR)


def test_a_zero_or_negative_duration_never_reaches_a_rate():
    """The learned remote rate once read -428 tokens/s: whatever a reply says, a duration
    that is not positive is rejected, and a tiny prefill is no sample at all."""
    est = PDEstimator()
    assert est.observe_remote("p:1", 7, 1000, -2.336) is False
    assert est.observe_remote("p:1", 7, 1000, 0.0) is False
    assert est.observe_remote("p:1", 7, 8, 1.0) is None
    assert est.observe_transfer("p:1", 7, 4096, 0.0) is False
    assert est.observe_transfer("p:1", 7, 0, 1.0) is None
    assert est.observe_local(100, -1.0) is False
    r = est.rates("p:1")
    assert (r.local_tokens_per_s, r.remote_tokens_per_s, r.transfer_bytes_per_s) == \
        (PRIOR_PREFILL_TOKENS_PER_S, PRIOR_PREFILL_TOKENS_PER_S, PRIOR_TRANSFER_BYTES_PER_S)


def test_a_peers_new_process_starts_from_the_priors_other_peers_keep_theirs():
    est = PDEstimator()
    for _ in range(20):
        est.observe_local(500, 1.0)
        est.observe_remote("p:1", 7, 1000, 0.1)
        est.observe_remote("p:2", 9, 1000, 0.2)
        est.observe_transfer("p:1", 7, 10**8, 0.5)
    assert not est.new_epoch("p:1", 7) and not est.new_epoch("p:1", 0)
    assert est.new_epoch("p:1", 8)  # restarted
    one, two = est.rates("p:1"), est.rates("p:2")
    assert one.remote_tokens_per_s == PRIOR_PREFILL_TOKENS_PER_S
    assert one.transfer_bytes_per_s == PRIOR_TRANSFER_BYTES_PER_S
    assert two.remote_tokens_per_s == pytest.approx(5000, rel=0.05)
    assert one.local_tokens_per_s == pytest.approx(500, rel=0.05)
    assert est.observe_remote("p:1", 8, 1000, 0.1) and est.peer("p:1").remote.samples == 1
    est.observe_remote("p:1", 6, 1000, 0.1)  # a reply of yet another process resets too
    assert est.peer("p:1").remote.samples == 1 and est.peer("p:1").kv_epoch == 6


def _chooser() -> tuple[PDChooser, PrefillPeers, DecodeMetrics]:
    layout = common_pb2.KVLayout(model="m", block_size=16, num_layers=2, num_kv_heads=2,
                                 head_size=8, dtype=common_pb2.KV_DTYPE_FLOAT32)
    peers = PrefillPeers(layout, "grpc", "d:1", 1.0, 1.0)
    metrics = DecodeMetrics()
    return PDChooser(peers, metrics, 0.05, 1.0), peers, metrics


def test_chooser_counts_rejected_samples_and_publishes_rates_per_peer():
    pd, _, metrics = _chooser()
    peer = PrefillPeer("p:1", stub=None, worker_id="p:1", kv_epoch=7)
    bad = prefill_pb2.PrefillResponse(num_computed_tokens=1000, compute_seconds=-2.3,
                                      transferred_bytes=4096, transfer_seconds=0.01)
    pd.observe_remote(peer, bad, arrival_seconds=0.0)
    get = metrics.registry.get_sample_value
    assert get("baton_decode_pd_rejected_samples_total",
               {"kind": "remote_prefill_tokens_per_second"}) == 1
    assert get("baton_decode_pd_learned_rate", {"kind": "remote_prefill_tokens_per_second",
                                                "peer": "p:1"}) == PRIOR_PREFILL_TOKENS_PER_S
    assert get("baton_decode_pd_learned_rate", {"kind": "transfer_bytes_per_second",
                                                "peer": "p:1"}) < PRIOR_TRANSFER_BYTES_PER_S


def test_a_restart_seen_by_the_peers_resets_the_chooser_rates():
    pd, peers, metrics = _chooser()
    peer = PrefillPeer("p:1", stub=None, worker_id="p:1", kv_epoch=7)
    peers._seen("p:1", 7, handshake=False)
    ok = prefill_pb2.PrefillResponse(num_computed_tokens=1000, compute_seconds=0.1)
    pd.observe_remote(peer, ok, arrival_seconds=0.0)
    assert pd.estimator.rates("p:1").remote_tokens_per_s != PRIOR_PREFILL_TOKENS_PER_S
    peers._seen("p:1", 8, handshake=False)  # a new process answered on that address
    assert pd.estimator.rates("p:1").remote_tokens_per_s == PRIOR_PREFILL_TOKENS_PER_S
    assert metrics.registry.get_sample_value("baton_decode_prefill_peer_restarts_total") == 1


def test_the_remote_path_is_priced_with_the_rate_the_peer_measures_per_step():
    """The prefill worker's GetStats `prefill_tokens_per_s` replaces the rate learned from
    whole requests once it reports one (0: not measured yet, the learned one stands in);
    its queue is drained at that rate for the answer's age."""
    pd, peers, _ = _chooser()
    peer = PrefillPeer("p:1", stub=None, worker_id="p:1", kv_epoch=7)
    at = time.monotonic()
    peers._loads["p:1"] = PeerLoad(at, 0, 0, 0, 0, 0.0, 7, prefill_tokens_per_s=0.0)
    assert pd.rates(peer).remote_tokens_per_s == PRIOR_PREFILL_TOKENS_PER_S
    answered = time.monotonic() - 0.25  # an answer 0.25 s old (fresh: < STATS_MAX_AGE_S)
    peers._loads["p:1"] = PeerLoad(answered, 0, 1, 1000, 0, 0.0, 7, prefill_tokens_per_s=400.0)
    before = time.monotonic()
    req = pd.request(peer, None)
    after = time.monotonic()
    assert req.rates.remote_tokens_per_s == 400.0
    # 1000 less its age at 400 tokens/s, the age read between `before` and `after`
    assert int(1000 - (after - answered) * 400) <= req.prefill_waiting_tokens \
        <= int(1000 - (before - answered) * 400)
    assert req.prefill_waiting_tokens <= 900


def test_the_peer_queue_counts_what_this_worker_sent_it_unanswered():
    """A burst is decided before any GetStats answer can count the requests just sent: the
    queue estimate is at least the uncached tokens sent and not yet answered, and an answer
    that counts more wins; an ended call stops counting, a stale entry expires."""
    pd, peers, _ = _chooser()
    peer = PrefillPeer("p:1", stub=None, worker_id="p:1", kv_epoch=7)

    def answer(waiting: int) -> int:  # a fresh GetStats answer, then the estimate
        peers._loads["p:1"] = PeerLoad(time.monotonic(), 0, 0, waiting, 0, 0.0, 7,
                                       prefill_tokens_per_s=1e-9)
        return pd.request(peer, None).prefill_waiting_tokens

    assert answer(0) == 0
    pd.sent("p:1", "a", 242)
    pd.sent("p:1", "b", 300)
    pd.sent("p:2", "c", 1000)  # another peer's
    assert answer(0) == 542
    assert answer(5000) == 5000
    pd.done("p:1", "a")
    assert answer(0) == 300
    pd._sent["p:1"]["b"] = (300, time.monotonic() - SENT_MAX_AGE_S - 1)
    assert answer(0) == 0
