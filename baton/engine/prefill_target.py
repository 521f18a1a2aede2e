"""One step's prefill rows under `SchedulerConfig.prefill_target_tokens` (scheduler.py).

Prefill on a CPU (and on a GPU past a few hundred tokens a step) is compute-bound: a step of
3 × 300 prompt tokens takes about three times one of 300. Batching the three gives all of them
their first token at 3T; running them one after the other gives T, 2T, 3T at the same total
cost (plus one read of the weights per extra step). So a step starts no further prefill rows
once it holds `prefill_target_tokens` of them, in the policy's order; under shortest_first a
running partial prefill also yields its step to a waiting request with fewer uncached tokens
(shortest remaining processing time first: the mean-TTFT-optimal order for one server,
Schrage 1968). It keeps its blocks and resumes when it is the shortest again. A row that
would not complete its prefill this step joins no step holding one that does: a 250-token
chunk of a cold prompt beside a 60-token turn makes that turn's first token wait for the
chunk, while the cold prompt, which takes the same total compute either way, finishes no
sooner for it (the next step runs the chunk alone). Rows that complete still share a step up
to the target.

Bounds, so nothing starves and nothing stalls:
- a prefill older than `max_prefill_wait_s` (since arrival) does not count toward the
  target and runs beside the target's rows at its chunk cap: one such request a step, the
  first in order (arrival), so an overload of old prompts advances one at a time instead of
  filling every step with all of them (a step of four 512-token chunks takes ~5 s on one
  core here, and every short turn would wait for it);
- decode rows (one token left) never count and are never paused;
- the scheduler visits running partial prefills and waiting requests in one pass in policy
  order, so one that yields to a shorter request still runs in the same step while the step's
  prefill stays under the target (the shorter one was short, or could not be admitted): it
  never waits on a request that does not run, and no step is left without prefill for it.
"""
from __future__ import annotations

from baton.config import SchedulerConfig
from baton.engine.request import Request
from baton.engine.schedule_policy import aged


class PrefillStep:
    """One step's prefill rows counted against the target, and the rules that follow from
    them, for the candidates the scheduler visits in policy order (one `schedule()` pass).

    Args:
        config: the scheduler's config (prefill_target_tokens 0: every rule says go).
        now: monotonic seconds of this step.
    """

    def __init__(self, config: SchedulerConfig, now: float) -> None:
        self.config, self.now = config, now
        self.target = config.prefill_target_tokens
        self.tokens = 0  # prefill tokens planned that count toward the target
        self.aged_rows = 0  # prefill rows of requests older than max_prefill_wait_s
        self.completing = 0  # counted prefill rows that compute their prompt's last token

    def _counts(self, req: Request, num_computed: int) -> bool:
        """A prefill row (more than one token left) younger than max_prefill_wait_s."""
        return req.num_tokens - num_computed > 1 and not aged(req, self.now, self.config)

    def sits_out(self, req: Request) -> bool:
        """True when `req` starts no row this step whatever its size: an old request once the
        step holds an old row, a young one once the target is reached."""
        if not self.target:
            return False
        if aged(req, self.now, self.config):
            return self.aged_rows > 0
        return self.tokens >= self.target

    def cap(self, req: Request, num_computed: int, n: int) -> int:
        """`n` tokens of a row cut to what is left of the target once the step holds prefill
        (a step's first row keeps its chunk): a long prompt starting behind short ones takes
        only the rest of the step, so their first tokens do not wait for its whole chunk."""
        if self.target and self.tokens and self._counts(req, num_computed):
            return max(1, min(n, self.target - self.tokens))
        return n

    def defers(self, req: Request, num_computed: int, n: int) -> bool:
        """True when a row of `n` tokens from `num_computed` on waits for a later step: it
        counts toward the target, would not complete its prefill in this step, and the step
        already holds a counted row that completes (its first token would wait for this
        row's chunk; see the module docstring)."""
        return bool(self.target and self.completing and self._counts(req, num_computed)
                    and num_computed + n < req.num_tokens)

    def add(self, req: Request, num_computed: int, n: int) -> None:
        """Record a planned row of `n` tokens from `num_computed` on."""
        if req.num_tokens - num_computed > 1:
            if self._counts(req, num_computed):
                self.tokens += n
                self.completing += num_computed + n >= req.num_tokens
            else:
                self.aged_rows += 1
