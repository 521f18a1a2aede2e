"""Per-request sampling parameters, in the shape of vLLM's `SamplingParams`.

Order of operations in the `Sampler` (baton/engine/sampler.py): logit bias, then repetition,
frequency and presence penalties (baton/engine/penalties.py), temperature, then top-k, top-p,
min-p, then one draw (greedy: the argmax of the biased, penalized logits). A
`structured_output` masks the tokens its grammar forbids after the penalties and before
temperature (baton/engine/grammar.py). Stop conditions (`stop`, `stop_token_ids`, eos,
`max_tokens`, `min_tokens`, a grammar's end) are applied by the engine and the
`IncrementalDetokenizer`.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

# Temperatures below this are greedy: logits / T would overflow float32 long before T = 0
# (vLLM uses the same threshold, `_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class StructuredOutputKind(enum.IntEnum):
    """What a structured output's JSON value must be (values as in common.proto)."""

    JSON_OBJECT = 1  # any JSON object
    JSON_SCHEMA = 2  # valid under `StructuredOutput.json_schema`


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar of a request's output: `prefix`, one JSON value, `suffix`, then EOS.

    json_schema: the JSON Schema as JSON text (JSON_SCHEMA only); hashable, so compiled
    grammars are cached per distinct spec. prefix, suffix: literal text around the value (a
    forced hermes tool call: "<tool_call>\\n" and "\\n</tool_call>").
    """

    kind: StructuredOutputKind
    json_schema: str = ""
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StructuredOutputKind(self.kind))
        if self.kind == StructuredOutputKind.JSON_OBJECT and self.json_schema:
            raise ValueError("a json_object structured output takes no json_schema")
        if self.kind == StructuredOutputKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object")


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    n: number of completions for the prompt.
    temperature: logits are divided by it; 0 means greedy (argmax).
    top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p.
    top_k: keep the k most likely tokens; 0 or -1 turns it off.
    min_p: keep tokens whose probability is >= min_p * the most likely token's probability.
    seed: makes this request's samples reproducible whatever else is in the batch.
    max_tokens: most tokens to generate; None lets the engine go up to the context limit.
    min_tokens: before this many tokens eos and `stop_token_ids` cannot be sampled (their
        logits are -inf, as in vLLM) and stop strings are ignored.
    stop: strings that end generation; the output is cut before them (a str is one stop).
    stop_token_ids: token ids that end generation (besides eos).
    ignore_eos: keep generating after eos.
    logprobs: None for none; 0 for the chosen token's logprob only; k for it and the top k.
    prompt_logprobs: None for none; else each prompt token's logprob (after the first), its
        rank and the top k (vLLM's `prompt_logprobs`): the whole prompt is computed for it,
        never read from the prefix cache (its logits are needed at every position).
    include_stop_str_in_output: keep the matched stop string at the end of the output.
    skip_special_tokens: leave special tokens out of the output text.
    presence_penalty: in [-2, 2]; subtracted once from the logit of every token already in
        the output (OpenAI's and vLLM's definition).
    frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it occurs
        in the output.
    repetition_penalty: > 0 (1 = off); divides positive and multiplies negative logits of
        tokens in the prompt or the output (CTRL; vLLM's definition).
    logit_bias: token id → value in [-100, 100] added to its logit before sampling.
    structured_output: None, or the grammar the output must follow (JSON object / schema).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.logit_bias = {} if self.logit_bias is None else dict(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                 f"{self.prompt_logprobs}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must hold strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain an empty string")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got "
                             f"{self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias token id", token, low=0)
            _check_number("logit_bias value", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature ~ 0)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when a penalty depends on the prompt or output tokens."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)


def _check_int(name: str, value: object, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN compares false with everything and would slip through
        raise ValueError(f"{name} must not be NaN")
    if value in (float("inf"), float("-inf")):  # e.g. temperature inf: a uniform draw
        raise ValueError(f"{name} must be finite, got {value}")
