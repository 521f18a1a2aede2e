"""One streaming OpenAI request → one RequestRecord.

Every request is `stream: true` with `stream_options.include_usage`, `ignore_eos: true`, greedy
sampling, and the session's `X-Session-ID` header. Times are seconds on the run's clock.
TTFT ends at the first chunk that carries text; ITL samples are the gaps between text chunks;
output tokens come from `usage.completion_tokens` (text chunks counted when usage is missing).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from baton.bench.prepare import PreparedTurn

SESSION_HEADER = "X-Session-ID"
_OVERFLOW = ("maximum context length", "context length", "context_length_exceeded",
             "prompt is too long")


def is_context_overflow(error: str | None) -> bool:
    """The server refused the prompt as too long (AgentX ends the session there)."""
    return bool(error) and any(s in error.lower() for s in _OVERFLOW)


@dataclass
class RequestRecord:
    session_id: str
    turn_index: int
    start: float
    max_tokens: int
    expected_prompt_tokens: int         # our count (template + tokenizer, or chars/4)
    theo_hit: int                       # ideal cached tokens within the session tree
    global_hit: int = 0                 # ideal cached tokens counting the whole run so far
    end: float | None = None
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None    # server usage
    cached_tokens: int | None = None    # server usage.prompt_tokens_details.cached_tokens
    cached_by: dict | None = None       # Baton's baton_cached_by (source → tokens)
    recomputed_held_tokens: int | None = None  # Baton's baton_recomputed_held_tokens
    error: str | None = None
    cancelled: bool = False
    retry_after: float | None = None    # seconds, from a 429's Retry-After header

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (last chunk - first chunk) / (tokens - 1)."""
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        last = self.chunk_times[-1] if self.chunk_times else self.end
        return (last - self.first_token) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def build_body(model: str, pt: PreparedTurn) -> dict:
    return {**pt.body, "model": model, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}


def _chunk_text(chunk: dict) -> str:
    """The output a chunk carries: text, or a parsed tool call's JSON (a turn whose output is
    one call streams no text at all)."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or ""
        if delta.get("tool_calls"):
            text += json.dumps(delta["tool_calls"])
    return text


def _take_usage(rec: RequestRecord, usage: dict) -> None:
    rec.output_tokens = int(usage.get("completion_tokens") or rec.output_tokens)
    rec.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])
    if isinstance(details.get("baton_cached_by"), dict):
        rec.cached_by = details["baton_cached_by"]
    if details.get("baton_recomputed_held_tokens") is not None:
        rec.recomputed_held_tokens = int(details["baton_recomputed_held_tokens"])


async def _consume(resp: httpx.Response, rec: RequestRecord, clock: Callable[[], float]) -> None:
    counted, usage = 0, None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            rec.error = f"stream error: {str(chunk['error'])[:200]}"
            return
        if _chunk_text(chunk):
            now = clock()
            if rec.first_token is None:
                rec.first_token = now
            rec.chunk_times.append(now)
            counted += 1
        usage = chunk.get("usage") or usage
    rec.output_tokens = counted
    if usage:
        _take_usage(rec, usage)
    if rec.first_token is None:
        rec.error = "no tokens streamed"


def _seconds(value: str | None) -> float:
    """A Retry-After header's delay in seconds (the delay-seconds form; an absent or
    HTTP-date value reads as 1 s, the gateway's shortest Retry-After)."""
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


async def send(client: httpx.AsyncClient, model: str, pt: PreparedTurn, session_id: str,
               turn_index: int, clock: Callable[[], float], records: list[RequestRecord],
               global_hit: int = 0) -> RequestRecord:
    """Send one turn and stream the answer; the record is appended to `records` at once.

    Never raises for server or network errors (they land in `record.error`); a cancellation
    (the run's deadline) marks the record cancelled and propagates.
    """
    rec = RequestRecord(session_id=session_id, turn_index=turn_index, start=clock(),
                        max_tokens=pt.body["max_tokens"],
                        expected_prompt_tokens=pt.prompt_tokens, theo_hit=pt.theo_hit,
                        global_hit=global_hit)
    records.append(rec)
    try:
        async with client.stream("POST", pt.endpoint, json=build_body(model, pt),
                                 headers={SESSION_HEADER: session_id}) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                if resp.status_code == 429:
                    rec.retry_after = _seconds(resp.headers.get("retry-after"))
            else:
                await _consume(resp, rec, clock)
    except asyncio.CancelledError:
        rec.cancelled = True
        raise
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        rec.end = clock()
    return rec
