"""What a multi-turn agent session finds cached, turn by turn, on a running gateway.

    .venv/bin/baton up &                               # the default cluster (or any flags)
    .venv/bin/python benchmarks/session_cache.py --url http://127.0.0.1:8000 [--turns 6]

Each turn appends the model's reply and a tool result (alternating ~20 and ~150 tokens), as
an agent does, and prints the turn's prompt tokens, the previous turn's prompt + reply (what
the session's workers hold of it, less at most one partial block), cached_tokens, the
recomputed-held tokens Baton reports (`baton_recomputed_held_tokens`), where the cached
tokens came from, and the TTFT. A turn whose cached_tokens falls more than one block short
of what was held recomputed KV the cluster holds.
"""
from __future__ import annotations

import argparse
import json
import time

import httpx

WORDS = ("flight baggage seat fare route gate delay crew meal upgrade refund terminal "
         "booking window aisle lounge").split()


def tool_result(turn: int) -> str:
    """~20 tokens on odd turns, ~150 on even ones."""
    n = 12 if turn % 2 else 110
    return " ".join(f"{WORDS[(turn * 7 + i) % len(WORDS)]}{i % 10}" for i in range(n))


def one_turn(client: httpx.Client, model: str, messages: list, session: str,
             max_tokens: int) -> tuple[dict, str, float]:
    """(usage, reply text, TTFT seconds) of one streamed turn."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/chat/completions", json=body,
                       headers={"X-Session-ID": session}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text.append(c["delta"]["content"])
            usage = chunk.get("usage") or usage
    return usage, "".join(text), ttft or time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model id (default: the first listed)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--session", default=f"session-cache-{int(time.time())}")
    a = p.parse_args()
    with httpx.Client(base_url=a.url, timeout=300) as client:
        model = a.model or client.get("/v1/models").json()["data"][0]["id"]
        messages = [{"role": "system", "content": "You are a travel agent. Answer briefly."},
                    {"role": "user", "content": "Find me a flight from SFO to JFK tomorrow."}]
        held, short = 0, 0
        print("turn  prompt  held  cached  recomputed_held  ttft_ms  cached_by")
        for turn in range(a.turns):
            usage, reply, ttft = one_turn(client, model, messages, a.session, a.max_tokens)
            d = usage["prompt_tokens_details"]
            by = {k: v for k, v in d.get("baton_cached_by", {}).items() if v}
            print(f"{turn + 1:>4}  {usage['prompt_tokens']:>6}  {held:>4}  "
                  f"{d['cached_tokens']:>6}  {d.get('baton_recomputed_held_tokens', 0):>15}  "
                  f"{ttft * 1e3:>7.0f}  {by}")
            short += turn > 0 and d["cached_tokens"] < held - a.block_size
            held = usage["prompt_tokens"] + usage["completion_tokens"]
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"Tool result: {tool_result(turn)}"}]
        print(f"turns that recomputed held KV (cached < held - {a.block_size}): {short}")


if __name__ == "__main__":
    main()
