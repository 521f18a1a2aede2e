"""A 6-turn agent session on the default `baton up` (SmolLM2, every flag at its default): no
turn's prompt recomputes KV a worker of the cluster holds. Each turn appends the model's
reply and a tool result (alternating ~20 and ~150 tokens), as an agent does; whichever path
the P/D cost model picks, a turn's `cached_tokens` is at least the previous turn's prompt
and reply less one block. The same with every prefill remote (`--prefill-mode remote`):
there the prefill worker reads what only decode holds (its previous turn's reply) instead
of computing it (prefill_service/kv_pull.py), and `baton_recomputed_held_tokens` stays 0."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_cluster_e2e import baton_up

pytestmark = pytest.mark.slow
BLOCK = 16  # the default --block-size
WORDS = ("flight baggage seat fare route gate delay crew meal upgrade refund terminal "
         "booking window aisle lounge").split()


def tool_result(turn: int) -> str:
    """~20 tokens on odd turns, ~150 on even ones."""
    n = 12 if turn % 2 else 110
    return " ".join(f"{WORDS[(turn * 7 + i) % len(WORDS)]}{i % 10}" for i in range(n))


def run_session(client, model: str) -> list[tuple[int, int, int]]:
    """(prompt_tokens, completion_tokens, cached_tokens) of each of 6 turns."""
    messages = [{"role": "system", "content": "You are a travel agent. Answer briefly."},
                {"role": "user", "content": "Find me a flight from SFO to JFK tomorrow."}]
    turns = []
    for turn in range(6):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                           temperature=0,
                                           extra_headers={"X-Session-ID": "agent-1"})
        u = r.usage
        turns.append((u.prompt_tokens, u.completion_tokens,
                      u.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Tool result: {tool_result(turn)}"}]
    return turns


@pytest.mark.parametrize("flags", [(), ("--prefill-mode", "remote")],
                         ids=["default", "all-remote"])
def test_no_turn_recomputes_what_the_cluster_holds(flags):
    with baton_up("smollm2-135m", *flags, num_blocks=None) as (url, _proc), \
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                          timeout=120) as client:
        turns = run_session(client, "smollm2-135m")
        held = [m for m in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                if m.startswith("baton_gateway_recomputed_held_tokens_total")]
    for k in range(1, len(turns)):
        prompt, reply, _ = turns[k - 1]
        assert turns[k][2] >= prompt + reply - BLOCK, (k, turns)
    assert held and float(held[0].split()[-1]) == 0, held
