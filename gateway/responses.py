"""Decode-worker messages → OpenAI responses: one JSON body, or SSE chunks.

    TokenChunk{index, token_ids, text_delta, logprobs}  ─▶  choices[index] text / delta
    Finished{index, finish_reason, usage, error}        ─▶  finish_reason, usage
                                                            (ERROR or ABORT → an error)

Chat output goes through the configured tool-call parser (gateway/tool_parsers.py) when the
request offered tools, so e.g. `<tool_call>{...}</tool_call>` becomes `message.tool_calls` and
finish_reason "tool_calls". Completions' `echo` puts the prompt's text before each choice's
(a stream: in the choice's first chunk, as vLLM sends it); with `echo_only` the generated
text is dropped. With echo and logprobs the prompt's tokens' logprobs come first (the decode
worker sends them on each choice's first chunk: SamplingParams.prompt_logprobs); vLLM's
`prompt_logprobs` field is added when asked (gateway/logprobs_output.py).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.choice import FINISH, Choice
from gateway.errors import DONE, GatewayError, error_code_of, sse_error
from gateway.logprobs_output import chat_logprobs, completion_logprobs, prompt_logprobs_field
from gateway.tool_calls import ParsedToolCall
from gateway.tool_parsers import ToolParsing
from protos import common_pb2

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class OutputSpec:
    """How to present one request's output. kind: "chat" or "completion". A request with
    several prompts (gateway/batch.py) has n choices per prompt, choice index
    prompt_i * n + j; prompt_lens: each prompt's length. tool_parser: how
    tool calls are parsed (gateway/tool_parsers.py ToolParsing), else None. echo:
    each prompt's text when completions echo it; echo_only: nothing else (max_tokens 0).
    prompt_heads: each prompt's first token id (echoed logprobs start with it);
    prompt_logprobs: add vLLM's `prompt_logprobs` field; continuous_usage: a stream's every
    chunk carries its choice's usage so far (vLLM's stream_options.continuous_usage_stats).
    role: the answer's role, "assistant" unless a chat without a generation prompt continues
    another role's last message (vLLM's rule)."""

    kind: str
    response_id: str
    model: str
    created: int
    n: int
    prompt_lens: tuple[int, ...]
    num_logprobs: int | None = None
    tool_parser: ToolParsing | None = None
    include_usage: bool = False
    num_prompts: int = 1
    echo: tuple[str, ...] | None = None
    echo_only: bool = False
    prompt_heads: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    continuous_usage: bool = False
    role: str = "assistant"

    @property
    def echo_logprobs(self) -> bool:
        """Completions' echo with logprobs: the prompt's tokens lead each choice's (a chat's
        echo is text only, as vLLM's)."""
        return not self.chat and self.echo is not None and self.num_logprobs is not None

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def num_choices(self) -> int:
        return self.n * self.num_prompts

    def running_usage(self, c: Choice) -> dict | None:
        """Choice c's usage so far, for a chunk of it (None: not asked)."""
        if not self.continuous_usage:
            return None
        prompt = self.prompt_lens[c.index // self.n]
        return {"prompt_tokens": prompt, "completion_tokens": c.num_tokens,
                "total_tokens": prompt + c.num_tokens}

    def choices(self) -> list[Choice]:
        """Every choice, each holding its prompt's text when it is echoed."""
        return [Choice(i, self.tool_parser, self.echo[i // self.n] if self.echo else "")
                for i in range(self.num_choices)]


def finished_error(f) -> GatewayError | None:
    """A Finished that is not a normal end → the error to report (None when normal)."""
    if f.finish_reason in FINISH:
        return None
    if f.finish_reason == common_pb2.FINISH_REASON_ABORT:
        return GatewayError(503, "the request was aborted by the worker", code="aborted",
                            retry_after=1)
    return GatewayError(500, f.error or "the decode worker failed the request",
                        code="worker_error")


SOURCES = {v: common_pb2.KVSource.Name(v).removeprefix("KV_SOURCE_").lower()
           for v in common_pb2.KVSource.values() if v}  # 1 → "decode_pool", ...


def usage_dict(spec: OutputSpec, usages: dict[int, common_pb2.Usage], counted: int) -> dict:
    """OpenAI usage summed over the prompts' latest `usages` (prompt index → Usage); counts
    the workers left at 0 fall back to the gateway's own (prompt lengths, tokens relayed).

    Baton's extension inside prompt_tokens_details: `baton_cached_by` (cached_tokens by
    source: decode_pool, prefill_pool, host_tier, disk_tier, store; they sum to cached_tokens)
    and `baton_recomputed_held_tokens` (prompt tokens computed although a worker held them).
    """
    prompt = sum(u.prompt_tokens for u in usages.values()) or sum(spec.prompt_lens)
    completion = sum(u.completion_tokens for u in usages.values()) or counted
    by = dict.fromkeys(SOURCES.values(), 0)
    for u in usages.values():
        for c in u.cached_by:
            if c.source in SOURCES:
                by[SOURCES[c.source]] += c.num_tokens
    details = {"cached_tokens": sum(u.cached_tokens for u in usages.values()),
               "baton_cached_by": by,
               "baton_recomputed_held_tokens": sum(u.recomputed_held_tokens
                                                   for u in usages.values())}
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": details}


# ---- one JSON body ---------------------------------------------------------------------------
async def collect(spec: OutputSpec, messages: AsyncIterator, token_text: TokenText) -> dict:
    """Drain the stream into a chat.completion / text_completion body (GatewayError on failure)."""
    choices = spec.choices()
    usages: dict[int, common_pb2.Usage] = {}
    async for msg in messages:
        if msg.WhichOneof("kind") == "tokens":
            c = choices[msg.tokens.index]
            if not spec.echo_only:
                c.text.append(msg.tokens.text_delta)
            c.logprobs.extend(c.new_logprobs(spec, msg.tokens))
            c.num_tokens += len(msg.tokens.token_ids)
            continue
        f = msg.finished
        if (error := finished_error(f)) is not None:
            raise error
        c = choices[f.index]
        if c.parser is not None:
            content, calls = c.parser.feed("".join(c.text))
            tail, more = c.parser.finish()
            c.text, c.tool_calls = [content + tail], calls + more
        c.finish(f)
        usages[f.index // spec.n] = f.usage
    counted = sum(c.num_tokens for c in choices)
    body = {"id": spec.response_id,
            "object": "chat.completion" if spec.chat else "text_completion",
            "created": spec.created, "model": spec.model,
            "choices": [_final_choice(spec, c, token_text) for c in choices],
            "usage": usage_dict(spec, usages, counted)}
    if spec.chat and spec.prompt_logprobs:  # vLLM: the chat body's, the prompt's
        body["prompt_logprobs"] = prompt_logprobs_field(choices[0].prompt_lps, token_text)
    return body


def _final_choice(spec: OutputSpec, c: Choice, token_text: TokenText) -> dict:
    text = "".join(c.text)
    logprobs = None if spec.num_logprobs is None else chat_logprobs(c.logprobs, token_text) \
        if spec.chat else completion_logprobs(c.logprobs, token_text, head=c.head)
    if not spec.chat:
        out = {"index": c.index, "text": text, "logprobs": logprobs,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if spec.prompt_logprobs:
            out["prompt_logprobs"] = prompt_logprobs_field(c.prompt_lps, token_text)
        return out
    message: dict = {"role": spec.role, "content": text}
    if c.tool_calls:
        message["content"] = text.strip() or None
        message["tool_calls"] = [t.to_openai() for t in c.tool_calls]
    return {"index": c.index, "message": message, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


# ---- SSE ---------------------------------------------------------------------------------------
async def sse_events(spec: OutputSpec, messages: AsyncIterator,
                     token_text: TokenText) -> AsyncIterator[bytes]:
    """The stream as SSE `data:` lines ending in `data: [DONE]`; an error (a worker's
    Finished ERROR or ABORT, the decode worker failing mid-stream) becomes a
    `data: {"error": ...}` event, then `data: [DONE]`, and the stream ends."""
    choices = spec.choices()
    chunk = _ChunkWriter(spec)
    if spec.chat:  # one role chunk per choice (as OpenAI and vLLM send them), written with
        # the first token
        chunk.pending = b"".join(
            chunk([{"index": c.index, "delta": {"role": spec.role, "content": ""},
                    "logprobs": None, "finish_reason": None}], spec.running_usage(c))
            for c in choices)
    usages: dict[int, common_pb2.Usage] = {}
    left = spec.num_choices
    async for msg in messages:
        if msg.WhichOneof("kind") == "tokens":
            t = msg.tokens
            c = choices[t.index]
            text = "" if spec.echo_only else t.text_delta
            calls: list[ParsedToolCall] = []
            if c.parser is not None:
                text, calls = c.parser.feed(text)
            text = c.echoed(text)
            lps = _chunk_logprobs(spec, c, c.new_logprobs(spec, t), token_text)
            c.text.append(t.text_delta)
            c.num_tokens += len(t.token_ids)
            if text or lps or calls:
                yield chunk([_delta(spec, c, text, calls, len(c.tool_calls), lps, None)],
                            spec.running_usage(c))
            c.tool_calls += calls
            continue
        f = msg.finished
        if (error := finished_error(f)) is not None:
            yield sse_error(error)
            yield DONE  # every stream ends with [DONE], failed or not
            return
        c = choices[f.index]
        text, calls = c.parser.finish() if c.parser is not None else ("", [])
        text = c.echoed(text)  # a choice that generated no text still echoes its prompt
        base = len(c.tool_calls)
        c.tool_calls += calls
        c.finish(f)
        yield chunk([_delta(spec, c, text, calls, base, None, c.finish_reason)],
                    spec.running_usage(c))
        usages[f.index // spec.n] = f.usage
        left -= 1
        if left == 0:
            break
    if spec.include_usage:
        yield chunk([], usage_dict(spec, usages, sum(c.num_tokens for c in choices)))
    yield DONE


def _chunk_logprobs(spec: OutputSpec, c: Choice, lps: list, token_text: TokenText):
    """A chunk's logprobs (None without any): the choice's first with echoed logprobs starts
    at the prompt's first token and text offset 0; the others go on after the choice's text."""
    first = c.num_tokens == 0 and c.head is not None
    if spec.num_logprobs is None or not (lps or first):
        return None
    if spec.chat:
        return chat_logprobs(lps, token_text)
    return completion_logprobs(lps, token_text, c.text_offsets, head=c.head if first else None)


def _delta(spec: OutputSpec, c: Choice, text: str, calls: list[ParsedToolCall], base: int,
           lps, finish_reason: str | None) -> dict:
    """One choice's chunk; `base` is the index of the first of `calls` in the choice."""
    out: dict = {"index": c.index}
    if spec.chat:
        delta: dict = {"content": text} if text or not calls else {}
        if calls:
            delta["tool_calls"] = [{"index": base + k, **call.to_openai()}
                                   for k, call in enumerate(calls)]
        out["delta"] = delta
    else:
        out["text"] = text
    out["logprobs"] = lps
    out["finish_reason"] = finish_reason
    if finish_reason is not None:
        out["stop_reason"] = c.stop_reason
    return out


class _ChunkWriter:
    def __init__(self, spec: OutputSpec) -> None:
        self._head = {"id": spec.response_id,
                      "object": "chat.completion.chunk" if spec.chat else "text_completion",
                      "created": spec.created, "model": spec.model}
        self._usage_null = spec.include_usage
        self.pending = b""  # written before the next chunk

    def __call__(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = {**self._head, "choices": choices}
        if usage is not None or self._usage_null:
            body["usage"] = usage
        out = self.pending + b"data: " + json.dumps(body, ensure_ascii=False,
                                                    separators=(",", ":")).encode() + b"\n\n"
        self.pending = b""
        return out


class OpenAIPresenter:
    """Chat and completions output for gateway/relay.py: `collect`, `sse_events`, streams
    ending with an error event and [DONE]."""

    def __init__(self, spec: OutputSpec, token_text: TokenText) -> None:
        self.spec, self.token_text = spec, token_text

    async def collect(self, messages: AsyncIterator) -> dict:
        """The chat.completion / text_completion body."""
        return await collect(self.spec, messages, self.token_text)

    def events(self, messages: AsyncIterator) -> AsyncIterator[bytes]:
        """The chunks as SSE, ending with [DONE]."""
        return sse_events(self.spec, messages, self.token_text)

    def end_error(self, error: GatewayError) -> bytes:
        """An error event, then [DONE]."""
        return sse_error(error) + DONE

    def error_code(self, event: bytes) -> str | None:
        """The code of a `data: {"error": ...}` event (None for any other event)."""
        return error_code_of(event) if event.startswith(b'data: {"error"') else None
