"""The engine's side of speculative decoding (llm_engine.py): drafts before a step, the
verified tokens' accounting after it.

    step N   propose: every running decode request gets drafts (drafter.py), cut to what it
                      may still output (max_tokens, the context limit) and to what its grammar
                      accepts → Request.spec_token_ids
             schedule: its decode row carries them if the budget and the pool allow
             run + verify (spec/verify.py): 1 + accepted tokens out
             observe: the drafter adapts the request's draft length; the counters below
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from baton.config import SpeculativeConfig
from baton.engine.request import Request
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

    def add(self, request_id: str, session: SessionHint | None) -> None:
        self.drafter.add(request_id, session.session_id if session else None,
                         session is not None and session.end)

    def propose(self, running: Iterable[Request]) -> None:
        """Set spec_token_ids of every running request: drafts for a decode row, [] else."""
        k = self.config.num_speculative_tokens
        for req in running:
            room = min(k, req.max_tokens - len(req.output_token_ids) - 1,
                       self.max_model_len - req.num_tokens)
            if req.num_tokens - req.num_computed_tokens != 1 or room <= 0:
                req.spec_token_ids = []
                continue
            drafts = self.drafter.propose(req, room)
            if drafts and req.grammar is not None:
                drafts = drafts[:req.grammar.valid_prefix(drafts)]
            req.spec_token_ids = drafts

    def observe(self, request_id: str, num_drafted: int, num_accepted: int,
                totals: Totals) -> None:
        """A verified row: its drafted and accepted counts (vLLM's spec_decode counters)."""
        self.drafter.observe(request_id, num_drafted, num_accepted)
        totals.count_spec(num_drafted, num_accepted)

    def finish(self, req: Request) -> None:
        """The request ended (any status): drafter.finish."""
        self.drafter.finish(req)

    def end_session(self, session_id: str) -> None:
        self.drafter.end_session(session_id)
