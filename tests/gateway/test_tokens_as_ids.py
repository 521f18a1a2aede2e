"""vLLM's `return_tokens_as_token_ids`: logprobs name each token "token_id:N" (the request's
field, else the gateway's --return-tokens-as-token-ids); bytes, text offsets and
prompt_logprobs' decoded_token stay the token's own."""
from __future__ import annotations

from types import SimpleNamespace

from gateway.logprobs_output import (chat_logprobs, completion_logprobs, prompt_logprobs_field,
                                     token_id_text)
from gateway.prompts import PromptBuilder
from tests.gateway.conftest import MODEL, running_gateway
from tests.gateway.test_http_api import CHAT, post, sse_data
from tests.tiny_models import train_tokenizer


def _lps(ids):
    return [SimpleNamespace(token_id=i, logprob=-1.0, rank=1,
                            top=[SimpleNamespace(token_id=j, logprob=-2.0) for j in ids[:2]])
            for i in ids]


def test_token_names_are_ids_and_bytes_stay_the_tokens():
    prompts = PromptBuilder(train_tokenizer(), max_model_len=64)
    ids = prompts.tokenizer.encode("naïve café 🚀 ok", add_special_tokens=False)
    as_ids = token_id_text(prompts.token_text)
    chat = chat_logprobs(_lps(ids), as_ids)["content"]
    plain = chat_logprobs(_lps(ids), prompts.token_text)["content"]
    assert [e["token"] for e in chat] == [f"token_id:{i}" for i in ids]
    assert [e["bytes"] for e in chat] == [e["bytes"] for e in plain]
    assert chat[0]["top_logprobs"][1]["token"] == f"token_id:{ids[1]}"
    comp = completion_logprobs(_lps(ids), as_ids, head=ids[0])
    ref = completion_logprobs(_lps(ids), prompts.token_text, head=ids[0])
    assert comp["tokens"] == [f"token_id:{i}" for i in [ids[0], *ids]]
    assert comp["text_offset"] == ref["text_offset"]
    assert set(comp["top_logprobs"][1]) == {f"token_id:{i}" for i in (ids[0], ids[1])}
    decoded = prompt_logprobs_field(_lps(ids), as_ids)[1][str(ids[0])]["decoded_token"]
    assert decoded == prompts.token_text(ids[0])


async def test_the_request_field_and_the_gateway_flag(prompts, fake):
    body = {**CHAT, "logprobs": True, "top_logprobs": 1}
    async with running_gateway(prompts, [fake]) as gw:
        off = (await post(gw, "/v1/chat/completions", body)).json()
        on = (await post(gw, "/v1/chat/completions",
                         {**body, "return_tokens_as_token_ids": True})).json()
        streamed = sse_data((await post(gw, "/v1/chat/completions", {
            **body, "return_tokens_as_token_ids": True, "stream": True})).text)
        comp = (await post(gw, "/v1/completions", {
            "model": MODEL, "prompt": "x", "logprobs": 1,
            "return_tokens_as_token_ids": True})).json()
    plain = off["choices"][0]["logprobs"]["content"]
    named = on["choices"][0]["logprobs"]["content"]
    assert not any(e["token"].startswith("token_id:") for e in plain)
    ids = [int(e["token"].removeprefix("token_id:")) for e in named]
    assert [prompts.token_text(i) for i in ids] == [e["token"] for e in plain]
    assert [e["bytes"] for e in named] == [e["bytes"] for e in plain]
    assert [e["token"] for c in streamed if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]] == [e["token"] for e in named]
    assert all(t.startswith("token_id:") for t in comp["choices"][0]["logprobs"]["tokens"])
    async with running_gateway(prompts, [fake], return_tokens_as_token_ids=True) as gw:
        flag_on = (await post(gw, "/v1/chat/completions", body)).json()
        overruled = (await post(gw, "/v1/chat/completions",
                                {**body, "return_tokens_as_token_ids": False})).json()
    assert flag_on["choices"][0]["logprobs"]["content"] == named
    assert overruled["choices"][0]["logprobs"]["content"] == plain
