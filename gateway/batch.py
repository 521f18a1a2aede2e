"""Several prompts in one /v1/completions request, run as separate requests.

    prompt: ["a", "b"] or [[1, 2], [3]]   (at most MAX_PROMPTS), n completions each
      1. each prompt is tokenized and checked on its own and becomes its own TokenizedRequest
         ("<id>-<i>"), routed on its own by `Dispatcher.stream` (the client's session, if
         any, applies to every one of them);
      2. `merge_streams` waits for every prompt's first message, so a routing failure of any
         prompt is the HTTP error of the whole request (the others are cancelled), then
         relays messages as they come, renumbering choice j of prompt i to i * n + j
         (prompt-major, as OpenAI and vLLM number them);
      3. gateway/responses.py presents them as one response whose usage sums the prompts'.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.protocol import RequestError
from protos import decode_pb2

MAX_PROMPTS = 64

Prompt = str | list[int]


def prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """The prompts of a completions body: a string or token ids is one prompt, a list of
    strings or of token-id lists is several; RequestError past MAX_PROMPTS or for none."""
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (str, list)):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                           "prompt")
    return list(prompt)


async def merge_streams(streams: list[AsyncIterator[decode_pb2.GenerateResponse]], n: int
                        ) -> AsyncIterator[decode_pb2.GenerateResponse]:
    """One stream of the prompts' messages, choice indexes renumbered prompt-major (see the
    module docstring). Closing it closes every prompt's stream (which aborts its request)."""
    pumps: list[asyncio.Task] = []
    try:
        firsts = await _first_messages(streams)
        queue: asyncio.Queue = asyncio.Queue()
        for i, msg in enumerate(firsts):
            queue.put_nowait((i, msg))
        pumps = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
        left = len(streams)
        while left:
            i, msg = await queue.get()
            if msg is None:
                left -= 1
            elif isinstance(msg, BaseException):
                raise msg
            else:
                yield _renumbered(msg, i * n)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _first_messages(streams: list[AsyncIterator]) -> list:
    """Every stream's first message; the first failure cancels the others and is raised."""
    async def first(stream: AsyncIterator):
        return await anext(stream)

    tasks = [asyncio.ensure_future(first(s)) for s in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(i: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    """Stream i's messages after its first onto `queue` as (i, msg), then (i, None); an
    unexpected failure goes on the queue too (the dispatcher turns worker failures into
    Finished{ERROR} messages, so this is a bug, and it should surface)."""
    try:
        async for msg in stream:
            queue.put_nowait((i, msg))
    except Exception as e:
        queue.put_nowait((i, e))
    queue.put_nowait((i, None))


def _renumbered(msg: decode_pb2.GenerateResponse, base: int) -> decode_pb2.GenerateResponse:
    """`msg` with its choice index moved up by `base` (in place: each message is relayed once)."""
    part = msg.tokens if msg.WhichOneof("kind") == "tokens" else msg.finished
    part.index += base
    return msg
