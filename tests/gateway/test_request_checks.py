"""Requests the gateway refuses itself, as vLLM does, with a 400 naming the field: `n` past
the decode workers' limit (one --max-n for both), `top_logprobs` without `logprobs`,
`stream_options` without a stream."""
from __future__ import annotations

import grpc
import pytest

from baton.cluster.flags import parse_up_args, role_argv
from baton.json_schema import FIELD_METADATA
from baton.request_limits import DEFAULT_MAX_N, RequestLimits
from baton.worker.role_configs import DecodeConfig
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import MODEL, running_gateway
from tests.gateway.test_http_api import CHAT, post

COMPLETION = {"model": MODEL, "prompt": "Hi"}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMPLETION)])
async def test_n_past_the_workers_limit_is_a_400_naming_n(gateway, fake, path, body):
    """n=20 reached the decode worker, which refused it past its --max-n of 16; now the
    gateway refuses it first, naming `n`, and nothing reaches a worker."""
    sent = len(fake.servicer.requests)
    r = await post(gateway, path, {**body, "n": DEFAULT_MAX_N + 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    assert f"at most {DEFAULT_MAX_N}" in error["message"]
    assert len(fake.servicer.requests) == sent
    r = await post(gateway, path, {**body, "n": DEFAULT_MAX_N})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == DEFAULT_MAX_N


async def test_the_gateways_max_n_is_the_flag_decode_takes(prompts, fake):
    """One default, one flag: `baton up --max-n 4` reaches the gateway and the decode
    workers, and a gateway started with it refuses n=5 (gRPC front included)."""
    assert DecodeConfig().max_n == RequestLimits().max_n == DEFAULT_MAX_N
    up = parse_up_args(["--max-n", "4"])
    assert role_argv(up, "gateway") == role_argv(up, "decode") == ["--max-n", "4"]
    async with running_gateway(prompts, [fake], limits=RequestLimits(max_n=4)) as gw:
        r = await post(gw, "/v1/completions", {**COMPLETION, "n": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(gateway_pb2.GatewayGenerateRequest(
                        model=MODEL, text="x", sampling_params=common_pb2.SamplingParams(n=5)),
                        timeout=5):
                    pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (FIELD_METADATA, "sampling_params.n") in tuple(e.value.trailing_metadata())


async def test_top_logprobs_without_logprobs_is_a_400(gateway, fake):
    """It was silently ignored (no logprobs came back); vLLM answers 400."""
    sent = len(fake.servicer.requests)
    for logprobs in ({}, {"logprobs": False}):
        r = await post(gateway, "/v1/chat/completions", {**CHAT, **logprobs, "top_logprobs": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "top_logprobs" and "`logprobs` must be set to true" in \
            error["message"]
    assert len(fake.servicer.requests) == sent
    for fields in ({"top_logprobs": 0}, {"logprobs": True, "top_logprobs": 2}):
        r = await post(gateway, "/v1/chat/completions", {**CHAT, **fields})
        assert r.status_code == 200, (fields, r.text)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMPLETION)])
async def test_stream_options_without_stream_is_a_400(gateway, fake, path, body):
    """They were accepted and did nothing (no usage chunk can come without a stream); OpenAI
    and vLLM answer 400 naming the field. An empty or null stream_options sets nothing."""
    sent = len(fake.servicer.requests)
    for stream in ({}, {"stream": False}, {"stream": None}):
        r = await post(gateway, path, {**body, **stream,
                                       "stream_options": {"include_usage": True}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stream_options" and "stream=True" in error["message"]
    assert len(fake.servicer.requests) == sent
    for options in ({}, None):
        r = await post(gateway, path, {**body, "stream_options": options})
        assert r.status_code == 200, (options, r.text)
    r = await post(gateway, path, {**body, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage"' in r.text


async def test_max_tokens_past_the_room_left_is_cut_to_it(gateway, fake):
    """A prompt of p tokens with max_tokens past 1024 - p was a 400; vLLM cuts max_tokens to
    the room left and answers. max_tokens past the whole context stays a 400 naming it, and
    a prompt that leaves no room a 400 naming the prompt, both in vLLM's words."""
    prompt = [7] * 1000
    r = await post(gateway, "/v1/completions", {**COMPLETION, "prompt": prompt,
                                                "max_tokens": 500})
    assert r.status_code == 200, r.text
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 24
    r = await post(gateway, "/v1/completions", {**COMPLETION, "prompt": prompt,
                                                "max_tokens": 20})
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 20
    sent = len(fake.servicer.requests)
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 1025})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens"
    assert error["message"].startswith("max_tokens=1025 cannot be greater than max_model_len")
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 1025})
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # the field the client sent is named, as vLLM does
    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens=1025 cannot be greater")
    r = await post(gateway, "/v1/completions", {**COMPLETION, "prompt": [7] * 1024})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith("This model's maximum context length is 1024 tokens. "
                                       "However, your prompt contains 1024 input tokens")
    assert len(fake.servicer.requests) == sent


NULLS = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None, "min_tokens": None,
         "include_stop_str_in_output": None, "skip_special_tokens": None,
         "add_generation_prompt": None, "continue_final_message": None, "top_logprobs": None}


async def test_a_null_field_is_its_default(gateway, fake):
    """OpenAI's optional fields are nullable (`"n": null`, as clients that serialize every
    field send them) and vLLM reads a null as the default; Baton answered 400 "Input should
    be a valid integer (n)". A required field's null is still a 400 naming it."""
    r = await post(gateway, "/v1/chat/completions", {**CHAT, **NULLS,
                                                      "stream_options": {"include_usage": None}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None and len(r.json()["choices"]) == 1
    sp = fake.servicer.requests[-1].sampling_params
    assert (sp.n, sp.min_tokens, sp.ignore_eos, sp.skip_special_tokens) == (1, 0, False, True)
    r = await post(gateway, "/v1/completions", {**COMPLETION, "n": None, "echo": None,
                                                "stream": None, "min_tokens": None,
                                                "max_tokens": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world!"
    # completions' max_tokens null is OpenAI's default 16 (it was the whole context left)
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 16
    r = await post(gateway, "/v1/responses", {"model": MODEL, "input": "Hi", "stream": None,
                                              "store": None})
    assert r.status_code == 200, r.text
    r = await post(gateway, "/v1/messages", {"model": MODEL, "max_tokens": 5, "stream": None,
                                             "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    # (a null model is the served one: test_no_model_is_the_served_one)
    for path, body, field in (("/v1/chat/completions", {**CHAT, "messages": None}, "messages"),
                              ("/v1/completions", {**COMPLETION, "prompt": None}, "prompt")):
        r = await post(gateway, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "stop": [1]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": 3}, "tool_choice"),
    ("/v1/responses", {"model": MODEL, "input": 5}, "input")])
async def test_a_union_fields_error_names_the_field_not_pydantics_member(gateway, path, body,
                                                                         param):
    """`param` named pydantic's union member too ("prompt.str", "messages[0].content.str"):
    OpenAI's (and vLLM's) name the request's field."""
    r = await post(gateway, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert f"({param})" in r.json()["error"]["message"]


async def test_stop_token_ids_outside_the_vocabulary_are_a_400(gateway, fake, prompts):
    """An id the model cannot sample was accepted and could never stop anything; vLLM
    answers 400. Ids inside the vocabulary still reach the worker."""
    sent, vocab = len(fake.servicer.requests), prompts.vocab_size
    for bad in ([vocab], [-1], [2, vocab + 100], [10**10]):  # 10**10: a 500 (int32 wire)
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            r = await post(gateway, path, {**body, "stop_token_ids": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"].startswith("stop_token_ids")  # [i]: which
    for key in (str(2**31), str(2**40)):  # past the int32 wire: a 500
        r = await post(gateway, "/v1/completions", {**COMPLETION, "logit_bias": {key: 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert len(fake.servicer.requests) == sent
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "stop_token_ids": [vocab - 1]})
    assert r.status_code == 200, r.text
    assert list(fake.servicer.requests[-1].sampling_params.stop_token_ids) == [vocab - 1]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**32}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**63}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**40}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 2**32}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**32}, "max_tokens"),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2**32},
     "max_output_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2**32,
                      "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "top_k": 2**40,
                      "messages": [{"role": "user", "content": "Hi"}]}, "top_k")])
async def test_integers_past_the_wire_types_are_a_400_naming_the_field(gateway, fake, path,
                                                                       body, param):
    """max_tokens 2**32 or top_k 2**40 did not fit the workers' uint32/int32 fields: a 500
    "internal error: ValueError" when the message was built. Now a 400 naming the field
    (temperature past OpenAI's 0-2 too, as vLLM checks), and nothing reaches a worker."""
    sent = len(fake.servicer.requests)
    r = await post(gateway, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.get("param", param) == param and param in error["message"], r.text
    assert len(fake.servicer.requests) == sent


async def test_a_completions_suffix_is_a_400_not_ignored(gateway, fake):
    """Fill-in-the-middle is not served: a suffix was dropped without a word (the completion
    read as if it had been honoured); now vLLM's answer, a 400 naming it. An empty one is
    no suffix."""
    sent = len(fake.servicer.requests)
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "def f(x):",
                                                "suffix": "\n    return y", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert len(fake.servicer.requests) == sent
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "Hi", "suffix": "",
                                                "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/chat/completions", {"model": None, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"})])
async def test_no_model_is_the_served_one(gateway, fake, path, body):
    """vLLM's rule: a request without `model` (or with null) is for the served model; it was
    a 400 "Field required"."""
    r = await post(gateway, path, {**body, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


@pytest.mark.parametrize("extra,param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice")])
async def test_empty_tools_and_a_tool_choice_without_tools_are_a_400(gateway, fake, extra,
                                                                     param):
    """OpenAI's and vLLM's 400s: an empty `tools` array, and a tool_choice (other than
    "none") with no tools; both were served as a plain chat."""
    sent = len(fake.servicer.requests)
    r = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(fake.servicer.requests) == sent
    ok = await post(gateway, "/v1/chat/completions", {**CHAT, "tool_choice": "none"})
    assert ok.status_code == 200, ok.text


async def test_null_content_is_an_assistant_messages_only(gateway, fake):
    """OpenAI's and vLLM's 400: a user, system or tool message whose content is null (it was
    served as an empty turn); an assistant's null content (with tool calls) and a message
    without the field stay accepted, as vLLM accepts them."""
    sent = len(fake.servicer.requests)
    for role in ("user", "system", "tool"):
        r = await post(gateway, "/v1/chat/completions", {**CHAT, "messages": [
            {"role": "user", "content": "hi"}, {"role": role, "content": None}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[1].content"
    assert len(fake.servicer.requests) == sent
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for messages in ([{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
                     [{"role": "user"}]):
        r = await post(gateway, "/v1/chat/completions", {**CHAT, "messages": messages})
        assert r.status_code == 200, r.text
