"""The chat-template choice (gateway/chat_templates.py) and the shipped SmolLM2 tool template:
identical to SmolLM2's own without tools, tools and tool history rendered with them, turn k a
prefix of turn k+1 over a τ-bench conversation, and the warning for templates that drop tools."""
from __future__ import annotations

import copy
import gzip
import json
import logging
from pathlib import Path

import pytest

from gateway import chat_templates
from gateway.chat_templates import (
    SHIPPED,
    TEMPLATES_DIR,
    resolve_chat_template,
    template_digest,
    tools_ignored,
)
from gateway.config import GatewayConfig
from gateway.prompts import PromptBuilder
from tests.gateway.conftest import running_gateway

# SmolLM2-135M-Instruct's own template, byte for byte (its sha256 is the SHIPPED key).
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
SHIPPED_TEXT = (TEMPLATES_DIR / "smollm2_tools.jinja").read_text()
TRACE = Path(__file__).parents[2] / "baton/bench/traces/tau_bench/gpt-4o-airline.head48.json.gz"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
PLAIN = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y\n<tool_call> is just text here"}],
]


def builder(prompts: PromptBuilder, own: str, override: str | None = None) -> PromptBuilder:
    tok = copy.copy(prompts.tokenizer)
    tok.chat_template = own
    return PromptBuilder(tok, prompts.max_model_len, override)


def text_of(p: PromptBuilder, messages, tools=None, gen=True) -> str:
    return p.tokenizer.decode(p.chat_token_ids(messages, tools, gen))


def test_smollm2_gets_the_shipped_template_by_default(tmp_path):
    assert SHIPPED[template_digest(SMOLLM2)] == "smollm2_tools.jinja"
    assert resolve_chat_template(None, SMOLLM2) == SHIPPED_TEXT
    assert resolve_chat_template("tokenizer", SMOLLM2) is None
    assert resolve_chat_template(None, "{{ other }}") is None
    (tmp_path / "t.jinja").write_text("{{ mine }}")
    assert resolve_chat_template(str(tmp_path / "t.jinja"), SMOLLM2) == "{{ mine }}"
    with pytest.raises(ValueError, match="no such file"):
        GatewayConfig(decode=("127.0.0.1:1",), chat_template=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="tool-call-parser"):
        GatewayConfig(decode=("127.0.0.1:1",), tool_call_parser="nope")


@pytest.mark.parametrize("gen", [True, False])
def test_without_tools_identical_to_smollm2(prompts, gen):
    own, shipped = builder(prompts, SMOLLM2), builder(prompts, SMOLLM2, SHIPPED_TEXT)
    for messages in PLAIN:
        assert shipped.chat_token_ids(messages, None, gen) == own.chat_token_ids(
            messages, None, gen)


def test_real_smollm2_tokenizer_same_template_and_ids():
    folder = Path.home() / ".cache/baton/models/smollm2-135m"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 not converted here (make test prepares it)")
    p = PromptBuilder.from_folder(folder)
    assert p.tokenizer.chat_template == SMOLLM2 and p.chat_template == SHIPPED_TEXT
    own = PromptBuilder(p.tokenizer, p.max_model_len)
    for messages in PLAIN:
        assert p.chat_token_ids(messages) == own.chat_token_ids(messages)


def test_tools_and_tool_history_are_rendered(prompts):
    p = builder(prompts, SMOLLM2, SHIPPED_TEXT)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    text = text_of(p, history, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert json.dumps(TOOLS[0]) in text and "<tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text_of(p, [{"role": "system", "content": "S."}, *history], TOOLS).startswith(
        "<|im_start|>system\nS.\n\n# Tools")


def test_the_models_own_call_re_renders_as_it_was_generated(prompts):
    """What the model is asked to emit is what the history renders: turn k's prompt plus
    its output is a prefix of turn k+1's prompt, so the cache covers the call too."""
    p = builder(prompts, SMOLLM2, SHIPPED_TEXT)
    turn = [{"role": "user", "content": "Weather in Paris?"}]
    output = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    nxt = text_of(p, [*turn, call, {"role": "tool", "content": "18 C"}], TOOLS)
    assert nxt.startswith(text_of(p, turn, TOOLS) + output + "<|im_end|>\n")


def tau_conversations(count: int) -> list[list[dict]]:
    """The first `count` τ-bench conversations holding tool calls and tool results."""
    with gzip.open(TRACE, "rt") as f:
        records = json.load(f)
    return [r["traj"] for r in records if any(m.get("tool_calls") for m in r["traj"])][:count]


def test_turns_extend_each_other_over_a_tau_bench_conversation(prompts):
    p = builder(prompts, SMOLLM2, SHIPPED_TEXT)
    for index, traj in enumerate(tau_conversations(3)):
        names = sorted({c["function"]["name"] for m in traj for c in m.get("tool_calls") or []})
        tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in names]
        assert any(m["role"] == "tool" for m in traj)
        turns = [i for i, m in enumerate(traj) if m["role"] == "assistant"]
        previous: list[int] = []
        for i in turns:
            ids = p.chat_token_ids(traj[:i], tools)
            assert ids[:len(previous)] == previous, (index, i)
            previous = ids
        assert "<tool_call>" in p.tokenizer.decode(previous)


def test_tools_ignored_verdict(prompts):
    assert tools_ignored(builder(prompts, SMOLLM2).tokenizer, SMOLLM2)
    assert not tools_ignored(prompts.tokenizer, SHIPPED_TEXT)
    assert not builder(prompts, SMOLLM2, SHIPPED_TEXT).tools_ignored
    assert builder(prompts, SMOLLM2).tools_ignored
    assert not tools_ignored(prompts.tokenizer, "{{ raise_exception('no') }}")


async def test_tools_to_a_template_that_drops_them_warn(prompts, fake, caplog, monkeypatch):
    import httpx

    monkeypatch.setattr(chat_templates, "_warned", set())
    body = {"model": "tiny", "max_tokens": 3, "tools": TOOLS,
            "messages": [{"role": "user", "content": "hi"}]}
    async with running_gateway(builder(prompts, SMOLLM2), [fake]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            with caplog.at_level(logging.WARNING, logger="gateway.chat_templates"):
                for _ in range(2):
                    r = await c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200
                    assert r.headers["x-baton-warning"] == "tools ignored by the chat template"
                plain = await c.post("/v1/chat/completions", json={**body, "tools": None})
    assert "x-baton-warning" not in plain.headers
    assert sum("ignores them" in r.message for r in caplog.records) == 1  # once per process
    async with running_gateway(builder(prompts, SMOLLM2, SHIPPED_TEXT), [fake]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and "x-baton-warning" not in r.headers


THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
            "not enable_thinking %} <think></think>{% endif %}{% endif %}")


async def test_chat_template_kwargs_reach_the_template(prompts, fake):
    """vLLM's `chat_template_kwargs` (Qwen3's `{"enable_thinking": false}`) are passed to
    the template, on /v1/chat/completions and /tokenize; they were ignored. A key the
    renderer sets itself is a 400 naming the field."""
    import httpx

    p = PromptBuilder(prompts.tokenizer, prompts.max_model_len, THINKING)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    off = {**chat, "chat_template_kwargs": {"enable_thinking": False}}
    async with running_gateway(p, [fake]) as gw, \
            httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=off)
        assert r.status_code == 200 and "x-baton-ignored-fields" not in r.headers, r.text
        sent = p.tokenizer.decode(fake.servicer.requests[-1].prompt_token_ids)
        assert sent.endswith("assistant: <think></think>")
        await c.post("/v1/chat/completions", json=chat)
        assert p.tokenizer.decode(fake.servicer.requests[-1].prompt_token_ids).endswith(
            "assistant:")
        tokens = (await c.post("/tokenize", json=off)).json()["tokens"]
        assert p.tokenizer.decode(tokens).endswith("assistant: <think></think>")
        r = await c.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {
            "add_generation_prompt": False}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
