"""The engine's side of speculative decoding (llm_engine.py): drafts before a step, the
verified tokens' accounting after it.

    step N   propose: every running decode request gets drafts (drafter.py), cut to what it
                      may still output (max_tokens, the context limit) and to what its grammar
                      accepts, then to the lengths that maximise the step's expected tokens
                      per second at its measured cost (budget.py) → Request.spec_token_ids
             schedule: its decode row carries them if the budget and the pool allow
             run + verify (spec/verify.py): 1 + accepted tokens out
             observe: the drafter adapts the request's draft length; the acceptance
                      estimate and the counters below; observe_step: the step's cost
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from baton.config import SpeculativeConfig
from baton.engine.request import Request
from baton.engine.spec.budget import Acceptance, StepCosts, choose
from baton.engine.spec.drafter import Drafter
from baton.engine.spec.verify import Verifier
from baton.engine.stats import Totals
from baton.session_hints import SessionHint

logger = logging.getLogger(__name__)


class Speculation:
    """Drafts and counts for one engine (engine thread only)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, seed: int = 0) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = Drafter(config)
        rates = config.acceptance_rates() if config.synthetic_acceptance else ()
        if rates:
            logger.warning("BENCHMARK ONLY: speculative drafts are accepted at rates %s "
                           "whatever the model says; outputs are not the model's", rates)
        self.verifier = Verifier(rates, seed)  # the model runner's, for verified rows
        # the benchmark mode keeps its fixed lengths (points comparable with vLLM's)
        self.budget = config.step_budget and not rates
        self.costs = StepCosts()
        self.acceptance = Acceptance()

    def add(self, request_id: str, session: SessionHint | None) -> None:
        self.drafter.add(request_id, session.session_id if session else None,
                         session is not None and session.end)

    def propose(self, running: Iterable[Request]) -> None:
        """Set spec_token_ids of every running request: drafts for a decode row, [] else."""
        k = self.config.num_speculative_tokens
        rows, drafted = 0, []
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1:
                req.spec_token_ids = []
                continue
            rows += 1
            room = min(k, req.max_tokens - len(req.output_token_ids) - 1,
                       self.max_model_len - req.num_tokens)
            drafts = self.drafter.propose(req, room) if room > 0 else []
            if drafts and req.grammar is not None:
                drafts = drafts[:req.grammar.valid_prefix(drafts)]
            req.spec_token_ids = drafts
            if drafts:
                drafted.append(req)
            elif self.budget:
                self.acceptance.idle(req.request_id)
        if self.budget and drafted:
            rates = [(self.acceptance.rate(r.request_id), len(r.spec_token_ids)) for r in drafted]
            for req, n in zip(drafted, choose(rows, rates, self.costs)):
                req.spec_token_ids = req.spec_token_ids[:n]
                if not n:
                    self.acceptance.idle(req.request_id)

    def observe_step(self, decode_rows: int, drafted: int, prompt_tokens: int,
                     seconds: float) -> None:
        """A step's shape and wall time (drafting included); decode-only steps price drafts."""
        if self.budget:
            self.acceptance.step(drafted > 0)
            if not prompt_tokens:
                self.costs.observe(decode_rows, drafted, seconds)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int,
                totals: Totals) -> None:
        """A verified row: its drafted and accepted counts (vLLM's spec_decode counters)."""
        self.drafter.observe(request_id, num_drafted, num_accepted)
        self.acceptance.observe(request_id, num_drafted, num_accepted)
        totals.count_spec(num_drafted, num_accepted)

    def finish(self, req: Request) -> None:
        """The request ended (any status): drafter.finish."""
        self.drafter.finish(req)
        self.acceptance.forget(req.request_id)

    def end_session(self, session_id: str) -> None:
        self.drafter.end_session(session_id)
