"""How many of the drafted tokens a step verifies: the lengths that maximise the step's
expected output tokens per second (goodput), from measured step costs and each request's
acceptance (SmartSpec: Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput", arXiv 2406.14066, its greedy proposal-length choice).

    StepCosts.observe(rows, drafted, seconds)   a decode-only step: `rows` decode rows, `drafted`
                                                drafted tokens among them, its wall time
    StepCosts.ratio(rows, drafted)              that step's time over a plain step of `rows`
    Acceptance.rate(request_id)                 P(a request's next drafted token is accepted |
                                                the previous one was)
    choose(rows, proposals, costs) -> lengths   per request, how many of its drafts to verify

Why: a verify step's cost depends on the machine, the batch and the context. On the AMD EPYC
of issue 26 (fp32 SmolLM2-135M, batch 1) 8 drafted tokens cost 1.5 plain steps at a 500-token
context but 1.95 at 3,000, where 2 cost 1.2 (BENCHMARKS.md, "Again with a per-step draft
budget"); at batch 4 and 500 tokens, 8 per row cost 4 plain steps. A fixed cap of 8 per row lost most of the gain on τ-bench, whose
contexts are 2.5–4k tokens and whose drafts are accepted ~60 % of the time.

Model. A row drafting j tokens with conditional acceptance α emits 1 + α + α² + ... + α^j
tokens in expectation (geometric acceptance, as SmartSpec and Leviathan et al. 2023 assume).
The step's goodput is Σ_rows E_row / (ratio(rows, D) · plain step), D = Σ j. The marginal gain
of a row's next draft, α^(j+1), falls with j, so taking candidate tokens in decreasing gain and
keeping the best prefix (every prefix evaluated: costs need not be convex) gives the lengths.

Costs are learned from the engine's own decode-only steps (steps that also prefill are not
used): a plain step time per batch size (EWMA) and, per (batch size, drafted tokens), the
ratio of a verify step to it (EWMA; the first sample replaces the prior). Before a point is
measured its ratio is the prior 1 + PRIOR_PER_TOKEN · drafted (· PRIOR_ROWS / rows above
PRIOR_ROWS rows, where a step is compute-bound and its own cost grows with the rows), or the
largest ratio measured for fewer drafted tokens at that batch size if that is more
(optimistic either way, so it gets tried and measured). Ratios of a batch size are learned
once one of its plain steps was timed. Acceptance: per request, accepted / tried positions with a prior of
PRIOR_WEIGHT positions at the engine-wide rate; a request whose drafts were all cut decays
towards that (DECAY per step), and the engine-wide rate towards PRIOR_RATE in steps that
verify nothing, so text that turns repetitive later is drafted again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_PER_TOKEN = 0.06  # verify cost per drafted token, batch 1-4, 500-token context (EPYC)
PRIOR_ROWS = 4          # above this batch a drafted token is priced as a share of the rows
EWMA = 0.25
MAX_ROWS_KEY = 16       # batch sizes above this share one key
PRIOR_RATE = 0.6        # engine-wide acceptance before anything was verified
PRIOR_WEIGHT = 4.0      # positions the engine-wide rate counts for in a request's estimate
DECAY = 0.9


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA * (new - old)


@dataclass
class StepCosts:
    """Measured decode step costs (engine thread). See the module docstring."""

    plain_s: dict[int, float] = field(default_factory=dict)             # rows -> seconds
    ratios: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, drafted) -> x

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """A decode-only step of `rows` rows carrying `drafted` drafted tokens took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        key = min(rows, MAX_ROWS_KEY)
        if drafted == 0:
            self.plain_s[key] = _ewma(self.plain_s.get(key), seconds)
        elif key in self.plain_s:
            k = (key, drafted)
            self.ratios[k] = _ewma(self.ratios.get(k), seconds / self.plain_s[key])

    def curve(self, rows: int, max_drafted: int) -> list[float]:
        """ratio(rows, d) for d = 0..max_drafted, in one pass (the budget's per-step call)."""
        key, share = min(rows, MAX_ROWS_KEY), min(1.0, PRIOR_ROWS / rows)
        out, measured_max = [1.0], 0.0
        for d in range(1, max_drafted + 1):
            got = self.ratios.get((key, d))
            if got is None:
                got = max(1.0 + PRIOR_PER_TOKEN * d * share, measured_max)
            else:
                measured_max = max(measured_max, got)
            out.append(got)
        return out

    def ratio(self, rows: int, drafted: int) -> float:
        """Time of a step of `rows` rows with `drafted` drafted tokens over a plain one (≥ 0)."""
        return self.curve(rows, max(drafted, 0))[max(drafted, 0)]


@dataclass
class Acceptance:
    """Per-request conditional acceptance estimates (engine thread)."""

    engine_tried: float = 0.0
    engine_accepted: float = 0.0
    _req: dict[str, list[float]] = field(default_factory=dict)  # rid -> [accepted, tried]

    def engine_rate(self) -> float:
        return ((self.engine_accepted + PRIOR_WEIGHT * PRIOR_RATE)
                / (self.engine_tried + PRIOR_WEIGHT))

    def rate(self, request_id: str) -> float:
        acc, tried = self._req.get(request_id, (0.0, 0.0))
        return (acc + PRIOR_WEIGHT * self.engine_rate()) / (tried + PRIOR_WEIGHT)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verified draft: positions 1..accepted+1 were tried (the last only if drafted)."""
        if num_drafted <= 0:
            return
        tried = num_accepted + (num_accepted < num_drafted)
        s = self._req.setdefault(request_id, [0.0, 0.0])
        s[0] += num_accepted
        s[1] += tried
        self.engine_accepted += num_accepted
        self.engine_tried += tried

    def step(self, verified: bool) -> None:
        """Once per step: with nothing verified the engine-wide evidence fades towards
        PRIOR_RATE too (a run of misses must not stop drafting for good)."""
        if not verified:
            self.engine_accepted *= DECAY
            self.engine_tried *= DECAY

    def idle(self, request_id: str) -> None:
        """The request verified nothing this step: its own evidence fades towards the prior."""
        s = self._req.get(request_id)
        if s is not None:
            s[0] *= DECAY
            s[1] *= DECAY

    def forget(self, request_id: str) -> None:
        self._req.pop(request_id, None)


def choose(num_rows: int, proposals: list[tuple[float, int]], costs: StepCosts) -> list[int]:
    """Drafted tokens to verify per proposal: `proposals` = (acceptance rate, drafted tokens)
    of the rows that drafted; `num_rows` counts every decode row of the step (each emits at
    least one token). Returns one length per proposal, each ≤ its drafted tokens."""
    cand = sorted(((a ** (j + 1), i) for i, (a, n) in enumerate(proposals) for j in range(n)),
                  key=lambda c: -c[0])
    ratio = costs.curve(num_rows, len(cand))
    best, best_n, tokens = float(num_rows), 0, float(num_rows)
    for n, (gain, _) in enumerate(cand, 1):
        tokens += gain
        value = tokens / ratio[n]
        if value > best:
            best, best_n = value, n
    lengths = [0] * len(proposals)
    for _, i in cand[:best_n]:
        lengths[i] += 1
    return lengths
