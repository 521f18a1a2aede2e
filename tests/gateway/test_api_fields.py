"""Issue 16 through the gateway and a fake decode worker: penalties and logit_bias reach the
worker, lists of prompts in /v1/completions, /tokenize /detokenize /version, and ignored
fields named in a header."""
from __future__ import annotations

import asyncio
import logging

import grpc
import httpx
import pytest

import baton
from gateway.ignored_fields import HEADER, ignored_header
from protos import common_pb2, decode_pb2, decode_pb2_grpc
from tests.gateway.conftest import MODEL, Behavior, FakeWorker, running_gateway
from tests.gateway.fake_decode import FakeDecode
from tests.gateway.test_http_api import CHAT, post, sse_data


# ---- penalties and logit_bias ------------------------------------------------------------
async def test_penalties_and_logit_bias_reach_the_worker(gateway, fake):
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1.5, "repetition_penalty": 1.25,
              "logit_bias": {"50": -100, "7": 2.5}}
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        r = await post(gateway, path, {**body, **fields})
        assert r.status_code == 200, r.text
        sp = fake.servicer.requests[-1].sampling_params
        assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == \
            (0.5, -1.5, 1.25)
        assert [(b.token_id, b.bias) for b in sp.logit_bias] == [(7, 2.5), (50, -100.0)]
        assert HEADER not in r.headers


async def test_unset_penalties_are_off(gateway, fake):
    await post(gateway, "/v1/chat/completions", {**CHAT, "presence_penalty": None,
                                                  "logit_bias": None})
    sp = fake.servicer.requests[-1].sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0, 0, 1)
    assert not sp.logit_bias


async def test_infinite_or_nan_sampling_values_are_a_400(gateway, fake):
    """`1e400` parses as inf (it sampled uniformly), NaN as NaN: a 400 naming the field, and
    nothing reaches the worker."""
    sent = len(fake.servicer.requests)
    for field, raw in (("temperature", "1e400"), ("top_p", "NaN"), ("presence_penalty", "-1e999")):
        body = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "%s": %s}'
                % (MODEL, field, raw))
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as c:
            r = await c.post("/v1/chat/completions", content=body,
                             headers={"content-type": "application/json"})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
    assert len(fake.servicer.requests) == sent


# ---- several prompts in /v1/completions --------------------------------------------------
class PromptEcho(FakeDecode):
    """Answers completion j of a prompt whose first id is p with the text "p/j"; after the
    first chunk, a prompt waits p times the token delay, so prompts with smaller first ids
    finish sooner."""

    async def Generate(self, request, context):
        self.requests.append(request)
        first, n = request.prompt_token_ids[0], max(1, request.sampling_params.n)
        try:
            for j in range(n):
                if j == 1:
                    await asyncio.sleep(self.behavior.token_delay_s * first)
                yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(
                    index=j, token_ids=[first], text_delta=f"{first}/{j}"))
            usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                     completion_tokens=n, cached_tokens=1,
                                     recomputed_held_tokens=2, cached_by=[common_pb2.CachedTokens(
                                         source=common_pb2.KV_SOURCE_HOST_TIER, num_tokens=1)])
            for j in range(n):
                yield decode_pb2.GenerateResponse(finished=decode_pb2.Finished(
                    index=j, finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


@pytest.fixture
async def echo():
    worker = await FakeWorker.serve(PromptEcho(Behavior(token_delay_s=0.05)),
                                    decode_pb2_grpc.add_DecodeServiceServicer_to_server)
    yield worker
    await worker.stop(0)


BATCH = {"model": MODEL, "prompt": [[3, 9], [2], [1, 1, 1]], "n": 2}
TEXTS = ["3/0", "3/1", "2/0", "2/1", "1/0", "1/1"]  # prompt-major: index = prompt_i * n + j


async def test_prompt_list_is_one_response_indexed_prompt_major(prompts, echo):
    async with running_gateway(prompts, [echo]) as gw:
        r = await post(gw, "/v1/completions", BATCH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == TEXTS
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12,
                             "prompt_tokens_details": {
                                 "cached_tokens": 3, "baton_recomputed_held_tokens": 6,
                                 "baton_cached_by": {"decode_pool": 0, "prefill_pool": 0,
                                                     "host_tier": 3, "disk_tier": 0,
                                                     "store": 0}}}
    requests = echo.servicer.requests
    assert sorted(r.request_id for r in requests) == [f"{body['id']}-{i}" for i in range(3)]
    assert all(r.sampling_params.n == 2 for r in requests)


async def test_prompt_list_of_strings_tokenizes_each(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ["The", "A cat"]})
    assert [c["text"] for c in r.json()["choices"]] == ["Hello world!"] * 2
    got = sorted(list(q.prompt_token_ids) for q in fake.servicer.requests)
    want = sorted([gateway.prompts.text_token_ids("The"), gateway.prompts.text_token_ids(
        "A cat")])
    assert got == want


async def test_prompt_list_streams_with_prompt_major_indexes(prompts, echo):
    async with running_gateway(prompts, [echo]) as gw:
        r = await post(gw, "/v1/completions", {**BATCH, "stream": True,
                                                "stream_options": {"include_usage": True}})
    chunks = sse_data(r.text)
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks
             if c["choices"] and c["choices"][0]["text"]}
    assert [texts[i] for i in range(6)] == TEXTS
    finished = [c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"] == "stop"]
    assert sorted(finished) == list(range(6))
    assert finished[0] >= 4  # the last prompt answers first, and is relayed as it comes
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 6
    assert len({c["id"] for c in chunks}) == 1


async def test_prompt_list_routing_failure_is_the_requests_error(prompts):
    worker = await FakeWorker.start(Behavior(reject=grpc.StatusCode.RESOURCE_EXHAUSTED))
    async with running_gateway(prompts, [worker]) as gw:
        for stream in (False, True):
            r = await post(gw, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"],
                                                   "stream": stream})
            assert r.status_code == 429 and "Retry-After" in r.headers
        assert gw.dispatcher.inflight == 0
    await worker.stop(0)


async def test_client_leaving_a_prompt_list_cancels_every_prompt(prompts):
    worker = await FakeWorker.start(Behavior(tokens=tuple((i, "x") for i in range(500)),
                                             token_delay_s=0.01))
    async with running_gateway(prompts, [worker]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
            body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 400, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    break
        for _ in range(200):
            if len(worker.servicer.cancelled) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(worker.servicer.cancelled) == 2
        assert gw.dispatcher.inflight == 0
    await worker.stop(0)


# ---- /tokenize, /detokenize, /version ---------------------------------------------------
async def test_tokenize_prompt_and_chat_and_detokenize(gateway):
    p = gateway.prompts
    r = await post(gateway, "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                          "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == p.tokenize("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024
    assert body["token_strs"] == p.tokenizer.convert_ids_to_tokens(body["tokens"])
    r = await post(gateway, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert r.json()["tokens"] == p.tokenize("Hello world", False)
    assert "token_strs" not in r.json()
    chat = (await post(gateway, "/tokenize", CHAT)).json()
    assert chat["tokens"] == p.chat_token_ids([{"role": "user", "content": "Hi there"}])
    no_prompt = (await post(gateway, "/tokenize", {**CHAT, "add_generation_prompt": False}))
    assert no_prompt.json()["count"] < chat["count"]
    r = await post(gateway, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]})
    assert r.json() == {"prompt": p.tokenizer.decode(chat["tokens"])}
    assert (await post(gateway, "/detokenize", {"tokens": []})).json() == {"prompt": ""}


async def test_version(gateway, fake):
    """The version, and the dtype each worker serves in once its stats arrived."""
    for _ in range(200):
        w = gateway.pool.get("decode", fake.address)
        if w is not None and w.stats is not None:
            break
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=gateway.http_url) as c:
        body = (await c.get("/version")).json()
    assert body["version"] == baton.__version__
    assert set(body) <= {"version", "commit", "workers_dtype"}
    assert body["workers_dtype"] == {fake.address: "float32"}


async def test_continue_final_message_continues_the_assistant_text(gateway, fake):
    """vLLM's continue_final_message: the prompt ends inside the last assistant message; with
    add_generation_prompt left true it is a 400 naming the field (as vLLM's)."""
    chat = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Well, hello"}]
    r = await post(gateway, "/v1/chat/completions", {
        "model": MODEL, "messages": chat, "continue_final_message": True,
        "add_generation_prompt": False})
    assert r.status_code == 200 and HEADER not in r.headers
    sent = fake.servicer.requests[-1].prompt_token_ids
    assert gateway.prompts.tokenizer.decode(sent).endswith("Well, hello")
    r = await post(gateway, "/v1/chat/completions", {
        "model": MODEL, "messages": chat, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    tok = await post(gateway, "/tokenize", {"messages": chat, "continue_final_message": True,
                                            "add_generation_prompt": False})
    assert tok.json()["tokens"] == list(sent)


async def test_without_a_generation_prompt_the_answer_takes_the_last_messages_role(gateway,
                                                                                   fake):
    """vLLM's get_chat_request_role: add_generation_prompt false answers in the last
    message's role (a continued user message is the user's), streamed or not."""
    for last, role in (("user", "user"), ("assistant", "assistant")):
        chat = [{"role": "user", "content": "Hi"}, {"role": last, "content": "Well"}]
        body = {"model": MODEL, "messages": chat, "continue_final_message": True,
                "add_generation_prompt": False}
        r = await post(gateway, "/v1/chat/completions", body)
        assert r.json()["choices"][0]["message"]["role"] == role, r.text
        r = await post(gateway, "/v1/chat/completions", {**body, "stream": True})
        assert f'"delta":{{"role":"{role}"' in r.text.replace(" ", ""), r.text
    r = await post(gateway, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(gateway, fake):
    """vLLM's truncate_prompt_tokens (it was ignored: the whole prompt was served, and a
    prompt over the context was a 400 that the field exists to avoid)."""
    ids = gateway.prompts.text_token_ids("one two three four five six")
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids,
                                                "truncate_prompt_tokens": 2})
    assert r.status_code == 200 and HEADER not in r.headers, r.text
    assert list(fake.servicer.requests[-1].prompt_token_ids) == ids[-2:]
    assert r.json()["usage"]["prompt_tokens"] == 2
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
    r = await post(gateway, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 3})
    whole = gateway.prompts.chat_token_ids(chat["messages"], None, True)
    assert list(fake.servicer.requests[-1].prompt_token_ids) == whole[-3:]
    too_long = [ids[0]] * (gateway.prompts.max_model_len + 10)
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": too_long,
                                                "max_tokens": 4, "truncate_prompt_tokens": 8})
    assert r.status_code == 200, r.text
    assert len(fake.servicer.requests[-1].prompt_token_ids) == 8
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": too_long,
                                                "max_tokens": 4, "truncate_prompt_tokens": -1})
    assert r.status_code == 400, r.text  # the whole context leaves no room for max_tokens
    for bad in (0, -2, gateway.prompts.max_model_len + 1, "x"):
        r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids,
                                                    "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


async def test_a_bug_is_a_500_in_the_api_shape_and_the_connection_serves_on(prompts, fake,
                                                                            monkeypatch,
                                                                            caplog):
    """An exception no handler knows is logged and answered 500; it no longer goes on to the
    server, which closed the connection (the client's next request on it got a reset)."""
    from gateway.http_api import Routes

    async def broken(self):
        raise ValueError("a bug")

    monkeypatch.setattr(Routes, "models", broken)
    async with running_gateway(prompts, [fake]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            for _ in range(3):
                r = await c.get("/v1/models")
                assert r.status_code == 500, r.text
                assert r.json()["error"] == {"message": "internal error: ValueError",
                                             "type": "server_error", "param": None,
                                             "code": None}
                assert (await c.get("/health")).status_code == 200
    assert "internal error on /v1/models" in caplog.text


async def test_chat_echo_puts_the_continued_message_first(gateway, fake):
    """vLLM's chat `echo` (it was ignored): the last message's content comes first in the
    answer when that message is in the answer's role, streamed or not; else nothing."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    body = {"model": MODEL, "messages": chat, "add_generation_prompt": False,
            "continue_final_message": True, "logprobs": True}
    plain = (await post(gateway, "/v1/chat/completions", body)).json()["choices"][0]
    r = await post(gateway, "/v1/chat/completions", {**body, "echo": True})
    assert r.status_code == 200 and HEADER not in r.headers, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello" + plain["message"]["content"]
    assert choice["logprobs"] == plain["logprobs"]  # the generated tokens' only
    r = await post(gateway, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in sse_data(r.text)
              if c["choices"]]
    assert "".join(deltas) == "Hello" + plain["message"]["content"]
    # the generation prompt starts a new assistant message: a user message is not echoed
    r = await post(gateway, "/v1/chat/completions", {
        "model": MODEL, "messages": chat[:1], "echo": True})
    assert not r.json()["choices"][0]["message"]["content"].startswith("Hi")


# ---- ignored fields ----------------------------------------------------------------------
async def test_ignored_fields_are_named_in_a_header_and_logged_once(gateway, caplog):
    body = {**CHAT, "foo": 1, "response_format": {"type": "json_object"}, "metadata": {"a": 1},
            "parallel_tool_calls": True, "echo": None,
            "stream_options": {"include_usage": True, "zz_part": True}}
    with caplog.at_level(logging.WARNING, logger="gateway.ignored_fields"):
        for stream in (True, True):
            r = await post(gateway, "/v1/chat/completions", {**body, "stream": stream})
            assert r.status_code == 200
            assert r.headers[HEADER] == "foo,stream_options.zz_part"
        r = await post(gateway, "/v1/chat/completions", {**body, "stream_options": None})
        assert r.status_code == 200 and r.headers[HEADER] == "foo"
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "gateway.ignored_fields"]
    assert len(logged) == 2 and all("/v1/chat/completions" in m for m in logged)
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                "response_format": {"type": "text"},
                                                "parallel_tool_calls": False})
    assert r.headers[HEADER] == "parallel_tool_calls"
    r = await post(gateway, "/tokenize", {"prompt": "x", "bar": 2})
    assert r.headers[HEADER] == "bar"


async def test_tool_choice_is_enforced_not_named(gateway):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "f"}}):
        r = await post(gateway, "/v1/chat/completions", {**CHAT, "tools": tools,
                                                          "tool_choice": choice, "zz": 1})
        assert r.headers[HEADER] == "zz", choice


def test_ignored_header_keeps_client_names_out_of_harms_way():
    assert ignored_header([]) == {}
    assert ignored_header(["a", "b\r\nSet-Cookie: x", "c,d"]) == {HEADER: "a,..."}
    names = [f"f{i:02d}" for i in range(40)]
    assert ignored_header(names)[HEADER].split(",") == names[:32] + ["..."]


# ---- legacy function calling ---------------------------------------------------------------
async def test_legacy_function_messages_are_accepted_as_tool_turns(gateway, fake):
    """role "function" was a 400 and an assistant's function_call was dropped; vLLM and
    OpenAI accept both. The worker gets the prompt of the same history in tool shapes."""
    ask = {"role": "user", "content": "Weather in Paris?"}
    args = '{"city": "Paris"}'
    legacy = [ask, {"role": "assistant", "content": None,
                    "function_call": {"name": "get_weather", "arguments": args}},
              {"role": "function", "name": "get_weather", "content": "18 C"}]
    tools = [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
              {"role": "tool", "name": "get_weather", "content": "18 C"}]
    sent = []
    for messages in (legacy, tools):
        r = await post(gateway, "/v1/chat/completions", {**CHAT, "messages": messages})
        assert r.status_code == 200, r.text
        sent.append(list(fake.servicer.requests[-1].prompt_token_ids))
    assert sent[0] == sent[1]
    assert "18 C" in gateway.prompts.tokenizer.decode(sent[0])
