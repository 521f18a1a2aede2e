"""Issue 25's cache target through the new fronts, on real workers (tiny model, in-process
gateway + decode + prefill, gRPC transport, the shipped tool-aware template):

- a Claude-Code-shaped 8-turn session through /v1/messages (the official `anthropic`
  client; a billing line in the system prompt that changes every turn, tools, tool_use →
  tool_result turns, Claude Code's session header) reports cache_read_input_tokens >= the
  previous turn's input less one block on every turn after the first, and a streamed turn's
  message_start states the same split as its end;
- a Codex-shaped 8-turn session through /v1/responses (the official `openai` client; the
  whole `input` every turn, store false, function_call → function_call_output items,
  prompt_cache_key) reports input_tokens_details.cached_tokens the same way.
Both with the production P/D decider and with every turn prefilled remotely (the decode
worker's held KV pulled by prefill, never recomputed)."""
from __future__ import annotations

import anthropic
import openai
import pytest_asyncio

from baton.chat_format import TEMPLATES_DIR
from gateway.prompts import PromptBuilder
from gateway.server import Gateway
from tests.gateway.conftest import gateway_config
from tests.services.helpers import BLOCK, FORCE_REMOTE, engine_config, start_decode, start_prefill

MODEL = "tiny"
TURNS = 8
# Small: the tiny model's 384-token vocabulary spends ~1 token per 2 characters of 1,024.
TOOL = {"name": "sh", "description": "Run",
        "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}}}


@pytest_asyncio.fixture(params=["default", "remote"])
async def stack(request, tiny_llama):
    """(gateway, decode server): the decider's production defaults, or remote from 16
    uncached tokens."""
    extra = FORCE_REMOTE if request.param == "remote" else {}
    engine = engine_config(tiny_llama, num_blocks=512)
    prefill = await start_prefill(tiny_llama, "grpc", engine=engine)
    decode = await start_decode(tiny_llama, "grpc", prefill.address, engine=engine, **extra)
    template = str(TEMPLATES_DIR / "smollm2_tools.jinja")
    gw = Gateway(gateway_config([decode.address], [prefill.address], model=MODEL,
                                rpc_timeout_s=5.0, first_token_timeout_s=60.0,
                                stream_idle_timeout_s=60.0),
                 PromptBuilder.from_folder(tiny_llama, chat_template_option=template))
    await gw.start()
    yield gw, decode
    await gw.stop()
    await decode.stop(drain_s=0)
    await prefill.stop(drain_s=0)


def _billing(turn: int) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.{turn}; "
                                    f"cc_entrypoint=cli; cch={turn * 7919 % 99991:05d};"}


def _assert_cached(turn: int, cached: int, previous_input: int | None) -> None:
    if previous_input is not None:
        assert cached >= previous_input - BLOCK, (turn, cached, previous_input)


async def test_claude_code_session_through_messages_reads_its_cache(stack):
    gw, decode = stack
    messages: list[dict] = [{"role": "user", "content": "List the files."}]
    previous = None
    async with anthropic.AsyncAnthropic(base_url=gw.http_url, api_key="x", max_retries=0,
                                        timeout=60) as client:
        for turn in range(TURNS):
            m = await client.messages.create(
                model=MODEL, max_tokens=4, messages=messages, tools=[TOOL],
                extra_body={"temperature": 0},
                system=[_billing(turn), {"type": "text", "text": "You are Claude Code."}],
                extra_headers={"x-claude-code-session-id": "cc-session"})
            total = m.usage.input_tokens + m.usage.cache_read_input_tokens
            _assert_cached(turn, m.usage.cache_read_input_tokens, previous)
            previous = total
            reply = [b.model_dump(exclude_none=True) for b in m.content if b.type == "text"]
            use = {"type": "tool_use", "id": f"toolu_{turn}", "name": "sh",
                   "input": {"c": f"ls {turn}"}}
            if turn % 2 == 0:  # the agent called a tool; its result comes back next turn
                messages.append({"role": "assistant", "content": reply + [use]})
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use["id"],
                     "content": f"a{turn}"}]})
            else:
                messages.append({"role": "assistant", "content": reply or "ok"})
                messages.append({"role": "user", "content": f"go {turn}"})
        # streamed, message_start states the split the decode worker's first chunk carries
        async with client.messages.stream(
                model=MODEL, max_tokens=4, messages=messages, tools=[TOOL],
                extra_body={"temperature": 0}, system="You are Claude Code.",
                extra_headers={"x-claude-code-session-id": "cc-session"}) as stream:
            start = [e async for e in stream if e.type == "message_start"][0].message.usage
            final = (await stream.get_final_message()).usage
    assert start.cache_read_input_tokens >= BLOCK
    assert (start.input_tokens, start.cache_read_input_tokens) == \
        (final.input_tokens, final.cache_read_input_tokens)
    assert previous > 8 * BLOCK  # the session really grew
    assert decode.metrics.registry.get_sample_value(
        "baton_decode_recomputed_held_tokens_total") in (None, 0.0)


async def test_codex_session_through_responses_reads_its_cache(stack):
    gw, decode = stack
    items: list[dict] = [{"role": "user", "content": "Fix the failing test."}]
    tools = [{"type": "function", "name": TOOL["name"], "description": TOOL["description"],
              "parameters": TOOL["input_schema"]}]
    previous = None
    async with openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="x", max_retries=0,
                                  timeout=60) as client:
        for turn in range(TURNS):
            r = await client.responses.create(
                model=MODEL, input=items, instructions="You are Codex.", tools=tools,
                max_output_tokens=4, temperature=0, store=False,
                prompt_cache_key="codex-thread")
            _assert_cached(turn, r.usage.input_tokens_details.cached_tokens, previous)
            previous = r.usage.input_tokens
            items += [o.model_dump(exclude_none=True) for o in r.output if o.type == "message"]
            if turn % 2 == 0:
                call = {"type": "function_call", "call_id": f"call_{turn}", "name": "sh",
                        "arguments": f'{{"c": "t{turn}"}}'}
                items += [call, {"type": "function_call_output", "call_id": call["call_id"],
                                 "output": f"f{turn}"}]
            else:
                items.append({"role": "user", "content": f"go {turn}"})
    assert previous > 8 * BLOCK
    assert decode.metrics.registry.get_sample_value(
        "baton_decode_recomputed_held_tokens_total") in (None, 0.0)
