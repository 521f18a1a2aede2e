"""Anthropic's Messages API: the official `anthropic` client against the gateway and a fake
decode worker (bodies, streams, tool round trips, count_tokens, errors, Claude Code's
session headers and billing line)."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.gateway.conftest import MODEL, Behavior, running_gateway
from tests.gateway.test_http_api import TOOL_TOKENS

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
async def gw(prompts, fake):
    async with running_gateway(prompts, [fake], api_key="k") as gw:
        yield gw


@pytest.fixture
async def client(gw):
    async with anthropic.AsyncAnthropic(base_url=gw.http_url, api_key="k", max_retries=0,
                                        timeout=10) as c:
        yield c


async def test_non_streaming_message(client, fake):
    fake.servicer.behavior = Behavior(cached_tokens=4)
    m = await client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                     system="Be brief.", stop_sequences=["zzz"],
                                     extra_body={"temperature": 0.5, "top_p": 0.9,
                                                 "top_k": 7})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hello world!"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    req = fake.servicer.requests[-1]
    sp = req.sampling_params
    assert (sp.max_tokens, sp.top_k, list(sp.stop)) == (8, 7, ["zzz"])
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    prompt = len(req.prompt_token_ids)
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens) == (prompt - 4, 4)
    assert m.usage.output_tokens == 3


async def test_streaming_message_and_its_event_sequence(gw, client, fake):
    async with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK) as stream:
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hello world!" and final.content[0].text == "Hello world!"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
    async with httpx.AsyncClient(base_url=gw.http_url, headers={"x-api-key": "k"}) as c:
        r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                "messages": ASK, "stream": True})
    names = [line[len("event: "):] for line in r.text.splitlines()
             if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * 3, "content_block_stop", "message_delta",
                     "message_stop"]


async def test_message_start_usage_splits_cached_and_uncached_input(gw, client, fake):
    """message_start counted the whole prompt as uncached input (cache_read 0) while
    message_delta split it; now both say input_tokens = uncached, cache_read_input_tokens =
    cached, summing to the prompt's length, as the non-streamed message does."""
    fake.servicer.behavior = Behavior(cached_tokens=4)
    async with httpx.AsyncClient(base_url=gw.http_url, headers={"x-api-key": "k"}) as c:
        r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                "messages": ASK, "stream": True})
    events = {line.split('"type":"')[1].split('"')[0]: json.loads(line[len("data: "):])
              for line in r.text.splitlines() if line.startswith("data: ")}
    prompt = len(fake.servicer.requests[-1].prompt_token_ids)
    split = {"input_tokens": prompt - 4, "cache_read_input_tokens": 4,
             "cache_creation_input_tokens": 0}
    assert events["message_start"]["message"]["usage"] == {**split, "output_tokens": 0}
    assert events["message_delta"]["usage"] == {**split, "output_tokens": 3}
    async with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK) as stream:
        async for event in stream:
            if event.type == "message_start":
                start = event.message.usage
        final = (await stream.get_final_message()).usage
    m = await client.messages.create(model=MODEL, max_tokens=8, messages=ASK)
    for u in (start, final, m.usage):
        assert (u.input_tokens, u.cache_read_input_tokens) == (prompt - 4, 4)


async def test_stop_sequence_and_max_tokens_stop_reasons(client, fake):
    m = await client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                     stop_sequences=[" world"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == \
        ("stop_sequence", " world", "Hello")
    m = await client.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert m.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_round_trip(client, fake, stream):
    """tool_use → tool_result → answer; the result reaches the prompt as a tool turn."""
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    kwargs = dict(model=MODEL, max_tokens=64, messages=ASK, tools=TOOLS)
    if stream:
        async with client.messages.stream(**kwargs) as s:
            first = await s.get_final_message()
    else:
        first = await client.messages.create(**kwargs)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use", "tool_use"]
    assert first.content[0].text == "Let me check."
    call = first.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("toolu_")
    fake.servicer.behavior = Behavior()
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                   {"type": "tool_result", "tool_use_id": first.content[2].id,
                    "content": [{"type": "text", "text": "12:00"}]}]}]
    answer = await client.messages.create(model=MODEL, max_tokens=8, messages=history,
                                          tools=TOOLS)
    assert answer.content[0].text == "Hello world!" and answer.stop_reason == "end_turn"
    prompt = fake.servicer.requests[-1].prompt_token_ids
    text = (await client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS))
    assert text.input_tokens == len(prompt)


async def test_forced_tool_choice_is_a_call_in_the_parsers_format(client, fake):
    await client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    so = fake.servicer.requests[-1].sampling_params.structured_output
    assert so.prefix == "<tool_call>\n" and so.suffix == "\n</tool_call>"
    assert json.loads(so.json_schema)["properties"]["name"] == {"const": "get_weather"}
    await client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=TOOLS,
                                 tool_choice={"type": "any"})
    schema = json.loads(fake.servicer.requests[-1].sampling_params.structured_output.json_schema)
    assert len(schema["anyOf"]) == 2
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK, tools=TOOLS,
                                 tool_choice={"type": "none"})
    sp = fake.servicer.requests[-1].sampling_params
    assert not sp.HasField("structured_output")


async def test_count_tokens_matches_the_prompt_sent(client, fake):
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK, system="S")
    counted = await client.messages.count_tokens(model=MODEL, messages=ASK, system="S")
    assert counted.input_tokens == len(fake.servicer.requests[-1].prompt_token_ids)


async def test_a_final_assistant_turn_is_continued(client, fake, prompts):
    """Anthropic's prefill: the answer continues the last assistant text (the prompt ends
    inside that turn, no new generation prompt); an empty final turn asks for nothing."""
    said = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    await client.messages.create(model=MODEL, max_tokens=8, messages=said)
    sent = prompts.tokenizer.decode(fake.servicer.requests[-1].prompt_token_ids)
    assert sent.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\nIt is"), sent
    counted = await client.messages.count_tokens(model=MODEL, messages=said)
    assert counted.input_tokens == len(fake.servicer.requests[-1].prompt_token_ids)
    await client.messages.create(model=MODEL, max_tokens=8, messages=[
        *ASK, {"role": "assistant", "content": ""}])
    plain = fake.servicer.requests[-1].prompt_token_ids
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK)
    assert fake.servicer.requests[-1].prompt_token_ids == plain


async def test_errors_are_anthropic_exceptions(client, fake, prompts):
    with pytest.raises(anthropic.NotFoundError) as e:
        await client.messages.create(model="claude-9", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model=MODEL, max_tokens=8, messages=[])
    assert e.value.body["type"] == "error"
    for empty in ("", []):  # Anthropic's 400; was sent to the model as an empty turn
        for messages in ([{"role": "user", "content": empty}],
                         [{"role": "user", "content": empty},
                          {"role": "assistant", "content": "Hi"}]):
            with pytest.raises(anthropic.BadRequestError) as e:
                await client.messages.create(model=MODEL, max_tokens=8, messages=messages)
            assert "messages.0: all messages must have non-empty content" in \
                e.value.body["error"]["message"]
    # Anthropic's 400s, each served before: a system prompt with no message, an empty text
    # block, a client tool without input_schema
    for kwargs, said in (({"system": "Be nice.", "messages": []}, "at least one message"),
                         ({"messages": [{"role": "user", "content": [
                             {"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}]},
                          "text content blocks must be non-empty"),
                         ({"messages": ASK, "tools": [{"name": "x", "description": "d"}]},
                          "tools.0.custom.input_schema: Field required")):
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=8, **kwargs)
        assert said in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.count_tokens(model=MODEL, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    fake.servicer.behavior = Behavior(fail_after=1)
    with pytest.raises(anthropic.APIStatusError):
        async with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK) as s:
            async for _ in s:
                pass
    assert len(fake.servicer.requests) == 1  # only the stream reached the worker


async def test_keys_x_api_key_or_bearer(gw):
    async with anthropic.AsyncAnthropic(base_url=gw.http_url, api_key="bad",
                                        max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            await c.messages.create(model=MODEL, max_tokens=8, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
    async with anthropic.AsyncAnthropic(base_url=gw.http_url, auth_token="k",
                                        max_retries=0) as c:  # Authorization: Bearer
        assert (await c.messages.create(model=MODEL, max_tokens=8, messages=ASK)).content


def _billing(turn: int) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{turn}.a1b; "
                                    f"cc_entrypoint=cli; cch={turn:05d};"}


async def test_the_billing_line_is_stripped_so_the_prefix_is_shared(client, fake):
    """Two requests differing only in Claude Code's billing line send the same ids."""
    for turn in (1, 2):
        await client.messages.create(
            model=MODEL, max_tokens=8, messages=ASK, tools=TOOLS,
            system=[_billing(turn), {"type": "text", "text": "You are Claude Code."}])
    first, second = fake.servicer.requests[-2:]
    assert list(first.prompt_token_ids) == list(second.prompt_token_ids)
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK, tools=TOOLS,
                                 system="You are Claude Code.")
    assert list(fake.servicer.requests[-1].prompt_token_ids) == list(first.prompt_token_ids)


async def test_claude_code_session_and_subagent_headers(client, fake):
    headers = {"x-claude-code-session-id": "cc-1"}
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                 extra_headers=headers)
    assert fake.servicer.requests[-1].session_id == "cc-1"
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_headers={
        **headers, "x-claude-code-agent-id": "a7"})
    assert fake.servicer.requests[-1].session_id == "cc-1:a7"
    await client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                 metadata={"user_id": "user-42"})
    assert fake.servicer.requests[-1].session_id == "user-42"


async def test_claude_codes_own_request_shape_is_served(gw, fake):
    """What Claude Code itself sends: `?beta=true`, anthropic-version / anthropic-beta
    headers, cache_control on system, message and tool blocks, a thinking config and fields
    nothing here acts on; streamed."""
    cache = {"type": "ephemeral"}
    body = {"model": MODEL, "max_tokens": 32, "stream": True,
            "system": [_billing(3), {"type": "text", "text": "You are Claude Code.",
                                     "cache_control": cache}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                {"type": "text", "text": "Weather in Paris?", "cache_control": cache}]}],
            "tools": [{**TOOLS[0], "cache_control": cache}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "user_abc_account_1_session_s1"},
            "context_management": {"edits": []}, "temperature": 1}
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-claude-code-session-id": "s1"}
    async with httpx.AsyncClient(base_url=gw.http_url, headers=headers, timeout=10) as c:
        r = await c.post("/v1/messages?beta=true", json=body)
        counted = await c.post("/v1/messages/count_tokens?beta=true",
                               json={k: body[k] for k in ("model", "system", "messages",
                                                          "tools")})
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ")]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta") == "Hello world!"
    assert events[-1]["type"] == "message_stop"
    req = fake.servicer.requests[-1]
    assert req.session_id == "s1"
    assert counted.status_code == 200 and \
        counted.json()["input_tokens"] == len(req.prompt_token_ids)


async def test_a_max_tokens_past_the_context_is_cut_to_the_room_left(client, fake):
    """Claude Code sends max_tokens 32,000 whatever the model: cut to the room the prompt
    leaves (max_model_len 1024 here), not refused as chat's past-the-context max_tokens is."""
    m = await client.messages.create(model=MODEL, max_tokens=32000, messages=ASK)
    req = fake.servicer.requests[-1]
    assert m.stop_reason == "end_turn"
    assert req.sampling_params.max_tokens == 1024 - len(req.prompt_token_ids)


async def test_an_empty_answer_has_no_empty_text_block(client):
    """A stop sequence that matches at once (or a forced tool call cut by max_tokens) left
    nothing to say: the body held `{"type": "text", "text": ""}`, a block Anthropic's API
    never answers and Baton itself refuses when an agent sends its history back (400 "text
    content blocks must be non-empty"). Now `content: []`, as the stream already gave."""
    m = await client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                     stop_sequences=["Hello"])
    assert m.content == [] and m.stop_reason == "stop_sequence"
    async with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK,
                                      stop_sequences=["Hello"]) as stream:
        assert (await stream.get_final_message()).content == []
