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

    new_token_ids: tokens sampled this step (0 or 1; more when a speculative row kept
    drafted tokens: baton/engine/spec/); text_delta: text now safe
    to stream; finish_reason: None while running, else "stop" | "length" | "abort" | "error";
    stop_reason: the stop string or stop token id that ended it, if any.
    prompt_logprobs: prompt tokens 1.. (SamplingParams.prompt_logprobs), on the output of
    its first token only.
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
    prompt_logprobs: list[TokenLogprob] | None = None  # on its first token, when asked


def merge_outputs(outs: list[StepOutput]) -> StepOutput:
    """One request's consecutive outputs of one step (a speculative row's tokens) as one
    delta: tokens, text and logprobs in order; every other field from the last."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    return StepOutput(
        request_id=last.request_id, new_token_ids=[t for o in outs for t in o.new_token_ids],
        text_delta="".join(o.text_delta for o in outs),
        logprobs=[lp for o in outs for lp in o.logprobs], finished=last.finished,
        finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens, error=last.error,
        cached_spans=last.cached_spans,
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None),
                             None))


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
    # vLLM's shape: None for the first prompt token, then each one's TokenLogprob (None
    # when SamplingParams.prompt_logprobs was not set)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
