"""/v1/completions `echo: true`, as vLLM answers it: the prompt's text before each choice's
text (a stream: in each choice's first chunk), a token-id prompt echoed as its decoded text,
`max_tokens: 0` returning the prompt alone; echo with logprobs is a 400 (no prompt logprobs)."""
from __future__ import annotations

import openai

from gateway.ignored_fields import HEADER
from tests.gateway.conftest import MODEL
from tests.gateway.test_http_api import post, sse_data

GENERATED = "Hello world!"  # what the fake decode worker answers


async def test_echo_puts_the_prompt_before_every_choice(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat",
                                                "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["The cat" + GENERATED] * 2
    assert HEADER not in r.headers  # it was named as an ignored field
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat"})
    assert r.json()["choices"][0]["text"] == GENERATED


async def test_token_and_listed_prompts_echo_their_own_text(gateway, fake):
    ids = gateway.prompts.text_token_ids("A dog")
    text = gateway.prompts.detokenize(ids)  # BOS included, as vLLM decodes a token prompt
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True})
    assert r.json()["choices"][0]["text"] == text + GENERATED
    assert list(fake.servicer.requests[-1].prompt_token_ids) == ids
    for prompts, texts in ((["One", "Two"], ["One", "Two"]),
                           ([[5, 6], [7]], [gateway.prompts.detokenize(p) for p in ([5, 6], [7])])):
        r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": prompts,
                                                    "echo": True, "n": 2})
        assert [c["text"] for c in r.json()["choices"]] == \
            [t + GENERATED for t in texts for _ in range(2)]  # choice index prompt_i * n + j


async def test_streamed_echo_comes_in_each_choices_first_chunk(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat",
                                                "echo": True, "n": 2, "stream": True})
    chunks = [c["choices"][0] for c in sse_data(r.text)]
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["text"] == "The cat" + "Hello"
        assert "".join(c["text"] for c in mine) == "The cat" + GENERATED


async def test_max_tokens_0_with_echo_returns_the_prompt_alone(gateway, fake):
    """vLLM allows it with echo: one token is generated (max_tokens 1) and dropped."""
    body = {"model": MODEL, "prompt": "The cat", "echo": True, "max_tokens": 0}
    r = await post(gateway, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "The cat"
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 1
    r = await post(gateway, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_data(r.text)) == "The cat"
    r = await post(gateway, "/v1/completions", {**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_echo_with_logprobs_is_a_400(gateway, fake):
    """It needs the prompt's logprobs, which the engine does not compute: refused, not
    answered without them."""
    sent = len(fake.servicer.requests)
    for logprobs in (0, 2):
        r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                    "echo": True, "logprobs": logprobs})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "echo"
        assert error["message"] == "echo with logprobs (prompt logprobs) is not supported"
    assert len(fake.servicer.requests) == sent


async def test_the_openai_client_streams_an_echo(gateway, fake):
    async with openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="k",
                                  max_retries=0, timeout=10) as client:
        c = await client.completions.create(model=MODEL, prompt="Hi", echo=True, max_tokens=5)
        assert c.choices[0].text == "Hi" + GENERATED
        stream = await client.completions.create(model=MODEL, prompt="Hi", echo=True,
                                                 stream=True)
        assert "".join([x.choices[0].text async for x in stream]) == "Hi" + GENERATED
        try:
            await client.completions.create(model=MODEL, prompt="Hi", echo=True, logprobs=1)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "echo with logprobs" in e.message
        else:
            raise AssertionError("echo with logprobs was answered")
