"""What the engine hands back: per-step deltas (for streaming) and whole results (offline)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The chosen token's logprob, its 1-based rank in the model's distribution (1 = most
    likely; 0 = unknown) and the top-n alternatives (token id → logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int = 0


@dataclass
class StepOutput:
    """One request's progress in one engine step (a streaming delta).

    new_token_ids: tokens sampled this step (0 or 1 per step today); text_delta: text now safe
    to stream; finish_reason: None while running, else "stop" | "length" | "abort" | "error";
    stop_reason: the stop string or stop token id that ended it, if any.
    cached_spans: where its num_cached_tokens came from in this engine, in prompt order
    ((KVSource, num_tokens) pairs: baton/engine/kv_source.py).
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    cached_spans: tuple = ()


@dataclass
class CompletionOutput:
    """One of the n completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """Result of one prompt (vLLM's shape). For n = 1 the completion's fields are also
    available directly: `output_token_ids`, `text`, `finish_reason`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool = True
    cached_spans: tuple = ()  # where num_cached_tokens came from (StepOutput.cached_spans)

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
