"""Prompt rendering (message normalization, tools, case 16) and tool-call parsing."""
from __future__ import annotations

import copy
import json

import pytest

from gateway.prompts import PromptBuilder, PromptError, normalize_message
from gateway.tool_calls import HermesParser as ToolCallParser
from tests.gateway.test_tool_parsers import run

# A Qwen2.5-style template: tools in a system block, tool calls rendered with
# `arguments | tojson` (expects a mapping), tool results as <tool_response>.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# SmolLM2's: plain ChatML that concatenates content (fails on None).
SMOLLM_LIKE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
               "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                 {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def with_template(prompts: PromptBuilder, template: str) -> PromptBuilder:
    tok = copy.copy(prompts.tokenizer)
    tok.chat_template = template
    return PromptBuilder(tok, prompts.max_model_len)


def test_normalize_message():
    m = normalize_message(HISTORY[2])
    assert m["content"] == ""
    assert m["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert normalize_message(HISTORY[1])["content"] == "Weather\nin Paris?"
    odd = normalize_message({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "not json"}}]})
    assert odd["tool_calls"][0]["function"]["arguments"] == "not json"
    with pytest.raises(PromptError):
        normalize_message({"role": "user", "content": [{"type": "image_url"}]})


def test_tool_history_renders_through_a_qwen_style_template(prompts):
    """Case 16: arguments arrive as JSON text, content as null; the template wants a mapping."""
    p = with_template(prompts, QWEN_LIKE)
    text = p.tokenizer.decode(p.chat_token_ids(HISTORY, TOOLS))
    assert '"arguments": {"city": "Paris"}' in text
    assert "<tools>" in text and "get_weather" in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant")


def test_null_content_renders_through_a_smollm_style_template(prompts):
    p = with_template(prompts, SMOLLM_LIKE)
    text = p.tokenizer.decode(p.chat_token_ids(HISTORY, TOOLS))  # tools ignored: fine
    assert "<|im_start|>assistant\n<|im_end|>" in text
    assert "Weather\nin Paris?" in text


def test_legacy_function_calling_renders_as_tool_turns(prompts):
    """OpenAI's legacy shapes (an assistant's function_call, a "function" result message)
    were a 400 (role) or dropped (function_call); vLLM and OpenAI accept them. They render
    as the tool call and tool result they are."""
    legacy = HISTORY[:2] + [
        {"role": "assistant", "content": None, "function_call": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"role": "function", "name": "get_weather", "content": "18 C"}]
    m = normalize_message(legacy[2])
    assert m["tool_calls"] == [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}] and "function_call" not in m
    assert normalize_message(legacy[3]) == {"role": "tool", "name": "get_weather",
                                             "content": "18 C"}
    p = with_template(prompts, QWEN_LIKE)
    assert p.chat_token_ids(legacy, TOOLS) == p.chat_token_ids(HISTORY, TOOLS)


def test_turns_extend_each_other(prompts):
    """Turn k's rendered prompt is a prefix of turn k+1's (what makes prefix caching hit)."""
    short = prompts.chat_token_ids(HISTORY[:2], add_generation_prompt=False)
    longer = prompts.chat_token_ids(HISTORY, add_generation_prompt=True)
    assert longer[:len(short)] == short


def test_developer_role_renders_as_system(prompts):
    """OpenAI's "developer" message is the system prompt: a template that does not name the
    role renders it as "system" (as the Responses API does); one that does keeps it."""
    p = with_template(prompts, SMOLLM_LIKE)
    said = [{"role": "user", "content": "Hi"}]
    dev = p.chat_token_ids([{"role": "developer", "content": "Be terse."}] + said)
    sys_ = p.chat_token_ids([{"role": "system", "content": "Be terse."}] + said)
    assert dev == sys_
    assert "<|im_start|>system\nBe terse." in p.tokenizer.decode(dev)
    knows = with_template(prompts, SMOLLM_LIKE.replace("{% for", "{# developer #}{% for"))
    text = knows.tokenizer.decode(knows.chat_token_ids(
        [{"role": "developer", "content": "Be terse."}] + said))
    assert "<|im_start|>developer\nBe terse." in text
    assert normalize_message({"role": "developer", "content": "x"}, False)["role"] == \
        "developer"


def test_continue_final_message_leaves_the_assistant_turn_open(prompts):
    p = with_template(prompts, SMOLLM_LIKE)
    chat = [{"role": "user", "content": "Say a number"},
            {"role": "assistant", "content": "The number is"}]
    text = p.tokenizer.decode(p.chat_token_ids(chat, add_generation_prompt=False,
                                               continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nThe number is")
    with pytest.raises(PromptError, match="cannot both"):
        p.chat_token_ids(chat, continue_final_message=True)


def test_template_errors_are_prompt_errors(prompts):
    p = with_template(prompts, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(PromptError, match="roles must alternate"):
        p.chat_token_ids([{"role": "user", "content": "x"}])
    with pytest.raises(PromptError):
        prompts.chat_token_ids([])
    with pytest.raises(PromptError):
        prompts.text_token_ids("")
    with pytest.raises(PromptError):
        prompts.check_token_ids([-1])


def feed_all(pieces: list[str]) -> tuple[str, list]:
    text, calls, _ = run("hermes", pieces)
    return text, calls


def test_tool_call_parser_pieces_and_holdback():
    body = '{"name": "f", "arguments": {"x": 1}}'
    whole = f"Sure.<tool_call>\n{body}\n</tool_call>"
    for cut in range(len(whole) + 1):  # every split point gives the same result
        text, calls = feed_all([whole[:cut], whole[cut:]])
        assert text == "Sure." and [c.name for c in calls] == ["f"]
        assert json.loads(calls[0].arguments) == {"x": 1}
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ("a ", [])  # held back: may open a call
    assert parser.feed("box>") == ("<toolbox>", [])


def test_tool_call_parser_edge_cases():
    text, calls = feed_all(["<tool_call>not json</tool_call> after"])
    assert text == "<tool_call>not json</tool_call> after" and not calls
    text, calls = feed_all(['<tool_call>{"name": "g", "arguments": "{}"}'])  # no closing tag
    assert text == "" and calls[0].arguments == "{}"
    text, calls = feed_all(["<tool_call>{\"name\": "])  # cut off and unparseable
    assert text == '<tool_call>{"name": ' and not calls
    text, calls = feed_all(["plain text <tool"])
    assert text == "plain text <tool" and not calls


def test_refusal_parts_are_text_and_a_text_part_needs_its_text():
    """OpenAI's assistant content may hold `refusal` parts (a replayed refusal): vLLM reads
    them as text; Baton answered 400 "content part of type 'refusal' is not supported". A
    text part without `text` said "of type 'text' is not supported": now it says what is
    missing."""
    m = normalize_message({"role": "assistant", "content": [
        {"type": "text", "text": "I can't "}, {"type": "refusal", "refusal": "help with that."}]})
    assert m["content"] == "I can't \nhelp with that."  # parts joined by "\n", as vLLM does
    with pytest.raises(PromptError, match="needs a `text` string"):
        normalize_message({"role": "user", "content": [{"type": "text"}]})


def test_text_parts_are_joined_by_a_newline_on_chat_and_responses():
    """A system prompt or input given in several text parts: vLLM joins them with "\\n";
    Baton joined them with nothing ("You are terse.Answer in French."), so the prompt, its
    token count and the greedy output differed from vLLM's on the same request."""
    from gateway.responses_protocol import ResponsesRequest, chat_messages
    parts = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]
    assert normalize_message({"role": "system", "content": parts})["content"] == \
        "You are terse.\nBe kind."
    body = ResponsesRequest.model_validate({"model": "m", "input": [{
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Hello"},
                    {"type": "input_text", "text": "World"}]}]})
    assert chat_messages(body)[0]["content"] == "Hello\nWorld"
