"""How fast this engine computes prompt tokens now, measured per step (engine thread).

    PrefillRate.observe(tokens, seconds)    once per step that computed prompt tokens
    PrefillRate.tokens_per_s                median of the last WINDOW steps' tokens/seconds
                                            (0.0 until measured)

A step's prompt tokens are the prefill rows' new tokens (rows with more than one token left,
as prefill_target.py counts them, so a preempted request's recompute counts); its seconds
are the whole step (schedule, forward, sampling), decode rows included, so the rate is what
a queued prompt sees: the worker drains `tokens` of prefill in about `tokens / tokens_per_s`
seconds while it keeps decoding beside. The median of a short window follows the rate as
context lengths, the batch and the threads (cpu_share.py) change, and one odd step does not
move it. (A first version, a ratio of two EWMAs seeded by the first step, read ~60 tokens/s
at the start of a bursts run on a prefill worker that does ~350, and the gateway refused
every request for seconds; which step did it was not isolated.)

Readers outside the worker (the gateway's SLO admission) get it in WorkerStats
`prefill_tokens_per_s`: a rate measured where the work runs, not learned from end-to-end
latencies, which also hold every queue the request waited in.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 9            # steps
MIN_STEP_TOKENS = 16  # fewer prompt tokens in a step measure its fixed cost, not the rate


@dataclass
class PrefillRate:
    """tokens_per_s: prompt tokens per second of step time over the last `window` steps
    with at least MIN_STEP_TOKENS prompt tokens (their median), 0.0 before the first."""

    window: int = WINDOW
    _rates: deque[float] = field(default_factory=deque)
    samples: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step computed `tokens` prompt tokens in `seconds` (wall time of the step)."""
        if tokens < MIN_STEP_TOKENS or seconds <= 0:
            return
        self._rates.append(tokens / seconds)
        if len(self._rates) > self.window:
            self._rates.popleft()
        self.samples += 1

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self._rates) if self._rates else 0.0
