"""A request's state inside one engine, and its ordered status enum."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from baton.engine.kv_source import Spans
from baton.outputs import TokenLogprob
from baton.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.grammar import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is finished (vLLM v1 convention).

    WAITING → (WAITING_FOR_REMOTE_KV →) RUNNING → FINISHED_*; RUNNING → PREEMPTED → RUNNING.
    """

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """One sequence being served.

    `num_computed_tokens` counts tokens of `all_token_ids` whose KV is in the cache;
    `num_cached_tokens` is how many of those came from a prefix-cache hit (or a remote
    prefill) when it was first scheduled, and `cached_spans` where in this engine they came
    from (pool or a tier, in prompt order: kv_source.py). `max_tokens` is resolved by the
    engine (never None). `prompt_logprobs` (when its params ask for them): prompt tokens
    1.. in order, filled as its prefill chunks run (model_runner.py); such a request never
    reads the prefix cache (scheduler.py), so its chunks start at position 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # -1 until first scheduled
    cached_spans: Spans = ()
    num_preemptions: int = 0
    scheduled_time: float | None = None  # time.monotonic() when it first joined the batch
    blocked_since: float | None = None  # time.monotonic() when admission first found no blocks
    admitted_time: float | None = None  # time.monotonic() when it last joined the batch
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # a structured output's matcher, advanced per token
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for its next decode row
    all_token_ids: list[int] = field(init=False)
    prompt_logprobs: list[TokenLogprob] | None = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.prompt_logprobs = None if self.sampling_params.prompt_logprobs is None else []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


def resolve_max_tokens(prompt_token_ids: list[int], max_tokens: int | None, vocab_size: int,
                       max_model_len: int) -> int:
    """Check a prompt against the model and the context limit; returns max_tokens resolved
    (None = all the room left). Raises ValueError: empty prompt, ids outside [0, vocab),
    no room to generate, or prompt + max_tokens over max_model_len."""
    if not prompt_token_ids:
        raise ValueError("prompt is empty: at least one token is required")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    n = len(prompt_token_ids)
    room = max_model_len - n
    if room < 1:
        raise ValueError(f"prompt has {n} tokens; the context limit is {max_model_len}, "
                         f"leaving no room to generate")
    max_tokens = room if max_tokens is None else max_tokens
    if max_tokens > room:
        raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                         f"context limit {max_model_len}")
    return max_tokens
