"""The rates the decode worker's P/D cost model (baton/pd_cost.py) prices paths with,
learned online from its own measurements: a local prefill's tokens over the time from being
scheduled to its first token, a remote prefill's computed tokens over the prefill worker's
compute_seconds, a transfer's bytes over its seconds. Event loop only.

Each is an EWMA starting from the priors (PRIOR_PREFILL_TOKENS_PER_S, PRIOR_TRANSFER_BYTES_PER_S)
until the first measurements land. A prefill of fewer than MIN_SAMPLE_TOKENS tokens measures
the step's fixed cost, not the rate, and is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.pd_cost import PRIOR_PREFILL_TOKENS_PER_S, PRIOR_TRANSFER_BYTES_PER_S, PDRates

EWMA_ALPHA = 0.2
MIN_SAMPLE_TOKENS = 16  # shorter prefills measure the step's fixed cost, not the rate


@dataclass
class Ewma:
    """Exponentially weighted moving average, starting from a prior."""

    value: float
    alpha: float = EWMA_ALPHA
    samples: int = 0

    def add(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)
        self.samples += 1


@dataclass
class PDEstimator:
    """Rates learned online from measured prefills and transfers (event loop only)."""

    local: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    remote: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    transfer: Ewma = field(default_factory=lambda: Ewma(PRIOR_TRANSFER_BYTES_PER_S))

    def observe_local(self, tokens: int, seconds: float) -> None:
        """A local prefill of `tokens` took `seconds` (joined the batch → first token)."""
        if tokens >= MIN_SAMPLE_TOKENS and seconds > 0:
            self.local.add(tokens / seconds)

    def observe_remote(self, tokens: int, seconds: float) -> None:
        """The prefill worker computed `tokens` in `seconds` (its compute_seconds)."""
        if tokens >= MIN_SAMPLE_TOKENS and seconds > 0:
            self.remote.add(tokens / seconds)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.transfer.add(num_bytes / seconds)

    def rates(self) -> PDRates:
        return PDRates(self.local.value, self.remote.value, self.transfer.value)
