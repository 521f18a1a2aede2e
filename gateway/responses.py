"""Decode-worker messages → OpenAI responses: one JSON body, or SSE chunks.

    TokenChunk{index, token_ids, text_delta, logprobs}  ─▶  choices[index] text / delta
    Finished{index, finish_reason, usage, error}        ─▶  finish_reason, usage
                                                            (ERROR or ABORT → an error)

Chat output goes through the configured tool-call parser (gateway/tool_parsers.py) when the
request offered tools, so e.g. `<tool_call>{...}</tool_call>` becomes `message.tool_calls` and
finish_reason "tool_calls". Completions' `echo` puts the prompt's text before each choice's
(a stream: in the choice's first chunk, as vLLM sends it); with `echo_only` the generated
text is dropped.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.errors import DONE, GatewayError, error_code_of, sse_error
from gateway.tool_calls import ParsedToolCall
from gateway.tool_parsers import make_tool_parser
from protos import common_pb2

TokenText = Callable[[int], str]
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class OutputSpec:
    """How to present one request's output. kind: "chat" or "completion". A request with
    several prompts (gateway/batch.py) has n choices per prompt, choice index
    prompt_i * n + j, and prompt_len the sum of the prompts' lengths. tool_parser: the
    parser's name (gateway/tool_parsers.py) when tool calls are parsed, else None. echo:
    each prompt's text when completions echo it; echo_only: nothing else (max_tokens 0)."""

    kind: str
    response_id: str
    model: str
    created: int
    n: int
    prompt_len: int
    num_logprobs: int | None = None
    tool_parser: str | None = None
    include_usage: bool = False
    num_prompts: int = 1
    echo: tuple[str, ...] | None = None
    echo_only: bool = False

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def num_choices(self) -> int:
        return self.n * self.num_prompts

    def choices(self) -> list[_Choice]:
        """Every choice, each holding its prompt's text when it is echoed."""
        return [_Choice(i, self.tool_parser, self.echo[i // self.n] if self.echo else "")
                for i in range(self.num_choices)]


class _Choice:
    def __init__(self, index: int, tool_parser: str | None, echo: str = "") -> None:
        self.index = index
        self.text: list[str] = [echo] if echo else []
        self.unsent_echo = echo  # a stream sends it with the choice's first chunk
        self.num_tokens = 0
        self.logprobs: list[common_pb2.TokenLogprobs] = []
        self.parser = make_tool_parser(tool_parser) if tool_parser else None
        self.tool_calls: list[ParsedToolCall] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def finish(self, f) -> None:
        self.finish_reason = _FINISH[f.finish_reason]
        self.stop_reason = getattr(f, f.WhichOneof("stop_reason")) if f.WhichOneof(
            "stop_reason") else None
        if self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"

    def echoed(self, text: str) -> str:
        """`text`, after the echoed prompt if that is not sent yet."""
        out, self.unsent_echo = self.unsent_echo + text, ""
        return out


def finished_error(f) -> GatewayError | None:
    """A Finished that is not a normal end → the error to report (None when normal)."""
    if f.finish_reason in _FINISH:
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
    prompt = sum(u.prompt_tokens for u in usages.values()) or spec.prompt_len
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


def logprobs_dict(spec: OutputSpec, lps, token_text: TokenText, offset: int = 0) -> dict:
    """OpenAI logprobs of some tokens: chat `{"content": [...]}`, completions' legacy shape."""
    if spec.chat:
        return {"content": [_chat_entry(lp, token_text) for lp in lps]}
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(t.token_id): t.logprob for t in lp.top} for lp in lps],
            "text_offset": offsets}


def _chat_entry(lp, token_text: TokenText) -> dict:
    text = token_text(lp.token_id)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := token_text(x.token_id)), "logprob": x.logprob,
                              "bytes": list(t.encode())} for x in lp.top]}


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
            c.num_tokens += len(msg.tokens.token_ids)
            c.logprobs.extend(msg.tokens.logprobs)
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
    return {"id": spec.response_id, "object": "chat.completion" if spec.chat else "text_completion",
            "created": spec.created, "model": spec.model,
            "choices": [_final_choice(spec, c, token_text) for c in choices],
            "usage": usage_dict(spec, usages, counted)}


def _final_choice(spec: OutputSpec, c: _Choice, token_text: TokenText) -> dict:
    text = "".join(c.text)
    logprobs = logprobs_dict(spec, c.logprobs, token_text) if spec.num_logprobs is not None \
        else None
    if not spec.chat:
        return {"index": c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    message: dict = {"role": "assistant", "content": text}
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
    if spec.chat:  # the role chunk goes out with the first token, in one write
        chunk.pending = chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None} for c in choices])
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
            lps = logprobs_dict(spec, t.logprobs, token_text, sum(map(len, c.text))) \
                if spec.num_logprobs is not None and t.logprobs else None
            c.text.append(t.text_delta)
            c.num_tokens += len(t.token_ids)
            if text or lps or calls:
                yield chunk([_delta(spec, c, text, calls, len(c.tool_calls), lps, None)])
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
        yield chunk([_delta(spec, c, text, calls, base, None, c.finish_reason)])
        usages[f.index // spec.n] = f.usage
        left -= 1
        if left == 0:
            break
    if spec.include_usage:
        yield chunk([], usage_dict(spec, usages, sum(c.num_tokens for c in choices)))
    yield DONE


def _delta(spec: OutputSpec, c: _Choice, text: str, calls: list[ParsedToolCall], base: int,
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
