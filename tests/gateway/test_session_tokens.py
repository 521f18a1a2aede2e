"""gateway/session_tokens.py: a session's prompt tokenized incrementally equals a full
tokenization on every turn of the shipped traces (τ-bench with its tools, SWE-agent), with
edited histories, interleaved sessions and an evicted session; and the reuse really happens."""
from __future__ import annotations

from pathlib import Path

import pytest

from baton.bench.loaders import load_swe_agent, load_tau_bench
from baton.bench.tokens import TokenCounter
from baton.bench.workload import Scaling
from baton.chat_format import normalize_message
from gateway.prompts import PromptBuilder
from gateway.session_tokens import SessionTokens, common_prefix

TRACES = Path(__file__).resolve().parents[2] / "baton" / "bench" / "traces"


def _sessions():
    counter, scaling = TokenCounter(None), Scaling()
    return (load_tau_bench(TRACES / "tau_bench" / "gpt-4o-airline.head48.json.gz", counter,
                           scaling)
            + load_swe_agent(TRACES / "swe_agent_trajectories", counter, scaling))


@pytest.fixture(scope="module")
def sessions():
    return _sessions()


def _replay_exact(builder: PromptBuilder, sessions) -> tuple[int, int]:
    """Every turn of every session: incremental ids == tokenizer.encode of the rendered text.
    Returns (turns checked, ids reused)."""
    turns = 0
    for s in sessions:
        tools = [dict(t) for t in s.tools] or None
        for turn in s.turns:
            messages = [dict(m) for m in turn.messages]
            ids = builder.chat_token_ids(messages, tools, session_id=s.name)
            text = builder.tokenizer.apply_chat_template(
                [normalize_message(m) for m in messages], tools=tools,
                chat_template=builder.chat_template, add_generation_prompt=True,
                tokenize=False)
            assert ids == builder.tokenizer.encode(text, add_special_tokens=False), \
                f"{s.name}: turn {turns}"
            turns += 1
    return turns, builder.sessions.reused


def test_every_turn_of_the_shipped_traces_is_exact(tiny_llama, sessions):
    builder = PromptBuilder.from_folder(tiny_llama)
    assert builder.encoder.enabled
    turns, reused = _replay_exact(builder, sessions)
    assert turns > 300 and reused > 0


@pytest.mark.slow
def test_every_turn_is_exact_with_smollm2_and_its_tool_template(sessions):
    from baton.models.registry import resolve_model
    builder = PromptBuilder.from_folder(resolve_model("smollm2-135m"))
    assert builder.chat_template is not None  # the shipped tool-aware template
    turns, reused = _replay_exact(builder, sessions)
    assert turns > 300 and reused > 0


def test_edited_history_interleaved_sessions_and_eviction(tiny_llama):
    builder = PromptBuilder.from_folder(tiny_llama)
    full = builder.tokenizer

    def check(sid: str, messages: list[dict]) -> list[int]:
        ids = builder.chat_token_ids(messages, session_id=sid)
        text = full.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ids == full.encode(text, add_special_tokens=False)
        return ids

    a = [{"role": "system", "content": "You are an agent."},
         {"role": "user", "content": "def add(a, b): return a + b"}]
    b = [{"role": "user", "content": "hello there"}]
    check("a", a)
    check("b", b)
    a += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    before = builder.sessions.reused
    check("a", a)
    assert builder.sessions.reused > before  # turn 2 reused turn 1's ids
    a[0]["content"] = "You are a different agent."  # edited system prompt: prefix changed
    check("a", a)
    a[1]["content"] += "x"  # a change right after a boundary token
    check("a", a)
    check("a", a[:2])  # a shorter prompt (history truncated)
    check("b", b + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}])
    small = SessionTokens(builder.encoder, max_tokens=8)
    first = small.encode("x", "<|im_start|>user\nhello<|im_end|>\n")
    small.encode("y", "<|im_start|>user\nother text here<|im_end|>\n")  # evicts x
    assert "x" not in small._entries and small.encode("x", "<|im_start|>user\nhello<|im_end|>\n"
                                                      ) == first


def test_common_prefix():
    assert common_prefix("abcdef", "abcxef") == 3
    assert common_prefix("abc", "abcdef") == 3
    assert common_prefix("", "abc") == 0
    assert common_prefix("x" * 1000 + "a", "x" * 1000 + "b") == 1000
