"""A request's SamplingParams finished for its prompt: the checks every front shares.

Each front translates its own sampling fields into a `common_pb2.SamplingParams` (the
workers' typed message); once the prompt is tokenized, `finished_params` checks what depends
on it or on the served model, as the workers will, and names the front's own field:

    context   the prompt must leave room in max_model_len; max_tokens is cut to the room
              left (unset: all of it), one past max_model_len is refused (vLLM's rules),
              except on a front whose max_tokens is a client's own cap (Messages: Claude
              Code sends 32,000 whatever the model), where it is cut to the room too
    stop      at most MAX_STOP non-empty strings
    min_tokens <= max_tokens
    logit_bias token ids in the vocabulary, each once, values in [-100, 100]
    stop_token_ids in the vocabulary (vLLM refuses an id the model cannot sample)
    the rest  baton.worker.wire.sampling_params_from_proto (the workers' own validation:
              ranges, NaN, a structured output without a kind)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from baton.worker.wire import sampling_params_from_proto
from gateway.errors import RequestError
from protos import common_pb2

MAX_STOP = 64
# The largest values the workers' wire fields hold (protos/common.proto: max_tokens and
# min_tokens uint32, top_k int32): a larger one is a 400 naming it, not a 500 when the
# message is built.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
MAX_BIAS = 100.0


@dataclass(frozen=True)
class FieldNames:
    """A front's names for the fields the shared checks name in errors (Messages:
    `stop_sequences`; Responses: `max_output_tokens`, `input`; completions: `prompt`), and
    `cap_past_context`: the front's max_tokens past max_model_len is cut to the room left
    instead of refused (Messages, whose clients send their product's output cap)."""

    max_tokens: str = "max_tokens"
    prompt: str = "messages"
    stop: str = "stop"
    logit_bias: str = "logit_bias"
    n: str = "n"
    cap_past_context: bool = False


def finished_params(wire: common_pb2.SamplingParams, prompt_len: int, max_model_len: int,
                    vocab_size: int, names: FieldNames = FieldNames()
                    ) -> common_pb2.SamplingParams:
    """A copy of `wire` with max_tokens set, after the checks of the module docstring;
    RequestError naming the front's field."""
    max_tokens = _max_tokens(wire, prompt_len, max_model_len, names)
    if len(wire.stop) > MAX_STOP or any(not s for s in wire.stop):
        raise RequestError(f"{names.stop} must hold at most {MAX_STOP} non-empty strings",
                           names.stop)
    if wire.min_tokens > max_tokens:
        raise RequestError("min_tokens must be <= max_tokens", "min_tokens")
    check_logit_bias(wire.logit_bias, vocab_size, names.logit_bias)
    if any(not 0 <= t < vocab_size for t in wire.stop_token_ids):
        raise RequestError(f"stop_token_ids must be token ids in [0, {vocab_size})",
                           "stop_token_ids")
    out = common_pb2.SamplingParams()
    out.CopyFrom(wire)
    out.max_tokens = max_tokens
    try:
        sampling_params_from_proto(out)
    except ValueError as e:
        raise RequestError(str(e)) from e
    return out


def _max_tokens(wire: common_pb2.SamplingParams, prompt_len: int, max_model_len: int,
                names: FieldNames) -> int:
    """The room left after the prompt, or the request's max_tokens when smaller (vLLM's
    rule: a max_tokens past the room is cut to it, not refused; one past max_model_len is
    refused, unless `names.cap_past_context`). RequestError naming the prompt when it
    leaves no room, in vLLM's words."""
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. "
                           f"However, your prompt contains {prompt_len} input tokens, which "
                           f"leaves no room for any output tokens. Please reduce the length "
                           f"of the input prompt.", names.prompt)
    if not wire.HasField("max_tokens"):
        return room
    if wire.max_tokens > max_model_len and not names.cap_past_context:
        raise RequestError(f"{names.max_tokens}={wire.max_tokens} cannot be greater than "
                           f"max_model_len={max_model_len}. Please request fewer output "
                           f"tokens.", names.max_tokens)
    return min(wire.max_tokens, room)


def check_logit_bias(bias, vocab_size: int, param: str = "logit_bias") -> None:
    """RequestError naming `param` for a token id outside the vocabulary or listed twice, or
    a value outside [-100, 100] (or not finite)."""
    seen: set[int] = set()
    for b in bias:
        if not 0 <= b.token_id < vocab_size:
            raise RequestError(f"logit_bias token id {b.token_id} is outside the vocabulary "
                               f"[0, {vocab_size})", param)
        if b.token_id in seen:
            raise RequestError(f"logit_bias lists token id {b.token_id} twice", param)
        seen.add(b.token_id)
        if not (math.isfinite(b.bias) and -MAX_BIAS <= b.bias <= MAX_BIAS):
            raise RequestError(f"logit_bias values must be in [-100, 100], got {b.bias}", param)


def logit_bias_entries(bias: dict[str, float] | None, param: str = "logit_bias"
                       ) -> list[common_pb2.TokenBias]:
    """OpenAI's logit_bias {"token id": value} → TokenBias entries, ids in order; RequestError
    for a key that is not a token id (the vocabulary and values: `check_logit_bias`)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", param)
        if int(key) > INT32_MAX:  # past any vocabulary, and past the wire's int32
            raise RequestError(f"logit_bias key {key} is not a token id of this model", param)
        if int(key) in out:
            raise RequestError(f"logit_bias lists token id {int(key)} twice", param)
        out[int(key)] = value
    return [common_pb2.TokenBias(token_id=t, bias=b) for t, b in sorted(out.items())]
