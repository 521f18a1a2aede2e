"""What the scheduler hands the model runner each step (typed; no model needed to build it).

    SchedulerOutput(scheduled=[ScheduledRequest(A, 1, [3, 9]), ScheduledRequest(C, 5, [4])],
                    preempted=[B])
"""
from __future__ import annotations

from typing import NamedTuple

from baton.engine.request import Request


class ScheduledRequest(NamedTuple):
    """One request's share of a step: `num_new_tokens` tokens from `num_computed_tokens` on,
    over `block_table` (block ids covering num_computed_tokens + num_new_tokens tokens).

    A decode row may carry drafted tokens (`spec_token_ids`, the last len(spec_token_ids) of
    its new tokens: speculative decoding, baton/engine/spec/): its query is its one known
    token followed by them, and every one of its positions is sampled and verified.
    """

    request: Request
    num_new_tokens: int
    block_table: list[int]
    spec_token_ids: tuple[int, ...] = ()

    @property
    def completes_prompt(self) -> bool:
        """True when this step computes the request's last known token (so it samples)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) \
            == r.num_tokens


class SchedulerOutput(NamedTuple):
    """One step's decision: the rows to run (running first, then admitted) and the requests
    preempted to make room (their blocks already freed, back in the waiting queue)."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]
