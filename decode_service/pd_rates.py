"""The rates the decode worker's P/D cost model (baton/pd_cost.py) prices paths with,
learned online from its own measurements: a local prefill's tokens over the time from being
scheduled to its first token, a remote prefill's computed tokens over the prefill worker's
compute_seconds, a transfer's bytes over its seconds. Event loop only. The prefill rates
stand in until the workers' engines have measured their per-step ones (pd_choice.py); the
transfer rate is always this one.

Each is an EWMA whose first measurement replaces its prior (PRIOR_PREFILL_TOKENS_PER_S,
PRIOR_TRANSFER_BYTES_PER_S: guesses, used until something is measured). A prefill of fewer
than MIN_SAMPLE_TOKENS tokens measures the step's fixed cost, not the rate, and is no
sample. A sample must be a rate (`Ewma.add`):

    not finite, or ≤ 0 (a zero or negative duration)    rejected: a measurement bug, never
                                                          a rate; a negative rate would price
                                                          a path below free
    over OUTLIER_FACTOR × the current value, or under    held back as an outlier; OUTLIER_RUN
    1/OUTLIER_FACTOR of it (once measured: the prior is   in a row on the same side mean the
    a guess, the first sample is taken as it is)          rate moved (another machine, other
                                                          flags): restart from their median

Why 100×: one EWMA step (α = 0.2) with a sample 100× the value multiplies the value by ~21,
so a single bad measurement would misprice a path by an order of magnitude for the next ~14
samples (0.8^14 ≈ 0.04); a real change between two prefills on one worker stays far below it
(batch composition, context length and --pin share's core count each move it by a few ×).

Remote rates (prefill compute and transfer) are per prefill peer *process*: a peer seen
with a new kv_epoch (it restarted, perhaps with other flags, load or hardware) starts again
from the priors (`PDEstimator.new_epoch`), not from what its predecessor measured.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from baton.pd_cost import PRIOR_PREFILL_TOKENS_PER_S, PRIOR_TRANSFER_BYTES_PER_S, PDRates

EWMA_ALPHA = 0.2
MIN_SAMPLE_TOKENS = 16  # shorter prefills measure the step's fixed cost, not the rate
OUTLIER_FACTOR = 100.0  # a sample this far from the current value is an outlier
OUTLIER_RUN = 3         # outliers in a row, same side: the rate moved, restart from them


@dataclass
class Ewma:
    """Exponentially weighted moving average from a prior (`value` at construction), with
    the sample checks of the module docstring. `rejected` counts samples not taken."""

    value: float
    alpha: float = EWMA_ALPHA
    samples: int = 0
    rejected: int = 0
    prior: float = field(default=math.nan, repr=False)  # default: the first `value`
    _outliers: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if math.isnan(self.prior):
            self.prior = self.value

    def add(self, x: float) -> bool:
        """Take one sample; False when it was rejected or held back as an outlier."""
        if not math.isfinite(x) or x <= 0:
            self.rejected += 1
            return False
        if self.samples and not self.value / OUTLIER_FACTOR <= x <= self.value * OUTLIER_FACTOR:
            return self._outlier(x)
        self._outliers.clear()
        # the first measurement replaces the prior (a guess): blended in at alpha, a prior
        # of 2,000 tokens/s still read ~1,050 after five samples of 590 (one EPYC core pair)
        self.value = x if not self.samples else self.value + self.alpha * (x - self.value)
        self.samples += 1
        return True

    def _outlier(self, x: float) -> bool:
        high = x > self.value
        if self._outliers and (self._outliers[-1] > self.value) != high:
            self._outliers.clear()  # a run is on one side only
        self._outliers.append(x)
        if len(self._outliers) < OUTLIER_RUN:
            self.rejected += 1
            return False
        self.value = statistics.median(self._outliers)
        self._outliers.clear()
        self.samples += 1
        return True

    def reset(self) -> None:
        """Back to the prior, as if nothing had been measured."""
        self.value, self.samples = self.prior, 0
        self._outliers.clear()


def _rate(amount: float, seconds: float) -> float:
    """amount / seconds; NaN (rejected by Ewma.add) for a duration that is not positive."""
    return amount / seconds if seconds > 0 else math.nan


@dataclass
class PeerRates:
    """What one prefill peer's process measured (kv_epoch 0: not known yet)."""

    kv_epoch: int = 0
    remote: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    transfer: Ewma = field(default_factory=lambda: Ewma(PRIOR_TRANSFER_BYTES_PER_S))


@dataclass
class PDEstimator:
    """Rates learned online from measured prefills and transfers (event loop only): this
    worker's local prefill rate, and per prefill peer (by address) its PeerRates."""

    local: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    peers: dict[str, PeerRates] = field(default_factory=dict)

    def peer(self, address: str) -> PeerRates:
        """The rates of the peer at `address` (the priors until it measured any)."""
        return self.peers.setdefault(address, PeerRates())

    def new_epoch(self, address: str, kv_epoch: int) -> bool:
        """The peer at `address` answered as process `kv_epoch`; True when its rates were
        another process's and restart from the priors (0 = unknown: nothing changes)."""
        p = self.peer(address)
        if not kv_epoch or kv_epoch == p.kv_epoch:
            return False
        restarted, p.kv_epoch = p.kv_epoch != 0, kv_epoch
        if restarted:
            p.remote.reset()
            p.transfer.reset()
        return restarted

    def observe_local(self, tokens: int, seconds: float) -> bool | None:
        """A local prefill of `tokens` took `seconds` (joined the batch → first token).
        None: too short to be a sample; else whether it was taken."""
        if tokens < MIN_SAMPLE_TOKENS:
            return None
        return self.local.add(_rate(tokens, seconds))

    def observe_remote(self, address: str, kv_epoch: int, tokens: int,
                       seconds: float) -> bool | None:
        """The prefill worker at `address` (process `kv_epoch`) computed `tokens` in
        `seconds` (its compute_seconds). None / bool as observe_local."""
        self.new_epoch(address, kv_epoch)
        if tokens < MIN_SAMPLE_TOKENS:
            return None
        return self.peer(address).remote.add(_rate(tokens, seconds))

    def observe_transfer(self, address: str, kv_epoch: int, num_bytes: int,
                         seconds: float) -> bool | None:
        """A transfer from that peer moved `num_bytes` in `seconds`; None when it moved
        nothing."""
        self.new_epoch(address, kv_epoch)
        if num_bytes <= 0:
            return None
        return self.peer(address).transfer.add(_rate(num_bytes, seconds))

    def rates(self, address: str) -> PDRates:
        """The rates to price a request whose remote path is the peer at `address`."""
        p = self.peer(address)
        return PDRates(self.local.value, p.remote.value, p.transfer.value)
