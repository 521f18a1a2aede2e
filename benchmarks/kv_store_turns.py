"""A 5-turn agent conversation through a running gateway: `cached_tokens` per turn, to see
what the next turn's prefill recomputes (with and without `baton up --kv-store mooncake`).

    baton up --num-blocks 256 [--kv-store mooncake] --min-remote-tokens 96 &
    python benchmarks/kv_store_turns.py [--url http://127.0.0.1:8000] [--max-tokens 48]

Each turn appends the previous answer (as the assistant message) and a tool result of a
fixed length (--tool-words per turn), greedy, one session (`user`). Prints per turn:
prompt tokens, `usage.prompt_tokens_details.cached_tokens`, `baton_recomputed_held_tokens`
(computed although a worker held them) and `baton_cached_by`, seconds, the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.request


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "flight", "seat", "price", "order", "status",
             "route", "hotel", "refund", "date", "city", "user", "total", "code", "note"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--tool-words", type=int, nargs="+", default=[20, 40, 30, 160, 40])
    p.add_argument("--session", default="kv-store-bench")
    a = p.parse_args()
    messages = [{"role": "system", "content": "You are a travel agent. " + _words(40, 0)}]
    for turn, n in enumerate(a.tool_words, 1):
        role = "user" if turn == 1 else "tool"
        messages.append({"role": role, "content": _words(n, turn)})
        start = time.perf_counter()
        out = _post(f"{a.url}/v1/chat/completions",
                    {"model": a.model, "messages": messages, "max_tokens": a.max_tokens,
                     "temperature": 0, "user": a.session})
        seconds = time.perf_counter() - start
        usage = out["usage"]
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", 0)
        held = details.get("baton_recomputed_held_tokens", "-")
        answer = out["choices"][0]["message"]["content"]
        print(f"turn {turn}: prompt {usage['prompt_tokens']:5d}  cached {cached:5d}  "
              f"recomputed-although-held {held:>5}  by {details.get('baton_cached_by')}  "
              f"{seconds:6.2f} s  load {os.getloadavg()[0]:.1f}", flush=True)
        messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    main()
