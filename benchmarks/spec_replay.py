"""Drafting policies replayed offline on recorded greedy outputs (issue 26): how many tokens
each verify step would emit, and what that saves at a measured verify cost.

    python benchmarks/spec_replay.py record --workload tau-bench --sessions 12 --out FILE
    python benchmarks/spec_replay.py replay FILE [--min-match 3] [--k 8] [--factor 1.0]
        [--cost 1,1.10,1.18,1.27,1.35,1.39,1.43,1.46,1.50]

Speculation never changes a greedy output, so a drafter can be judged without the model once
the outputs are known. `record` sends a replay workload's turns (`baton bench`'s loaders:
τ-bench or SWE-agent, real messages through the chat template with their tools, outputs
forced to each turn's recorded length capped at 128 tokens, greedy, ignore_eos: the requests
`baton bench` sends) through the offline engine, turn j of every session in one batch, and
writes each request's prompt and output token ids in session order. `replay` runs the real
`Drafter` (baton/engine/spec/drafter.py) over them as a c=1 run would (sessions one after the
other, each turn a request of its session): per step it proposes, accepts the longest
prefix that equals the recorded output (greedy verification), emits accepted + 1 tokens and
reports the result. It prints draft coverage (steps with a draft), acceptance, tokens per
step and the predicted speed-up = plain steps / Σ cost(k) with `--cost` the verify step's
cost per drafted length k = 0..8 relative to a plain one (default: batch 1 of
benchmarks/spec_verify_cost.py on the AMD EPYC VM, 2026-12-03; intermediate k interpolated):
overall and the median over requests (what TPOT p50 of `baton bench compare` reads).
The engine's per-step budget (spec/budget.py) is not replayed: it needs the measured step
times, so this shows what the drafter finds, not what a step verifies.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from statistics import median

from baton.bench.args import load_workload
from baton.bench.tokens import TokenCounter
from baton.config import SpeculativeConfig
from baton.engine.spec.drafter import Drafter

COST = "1,1.10,1.18,1.27,1.35,1.39,1.43,1.46,1.50"


@dataclass
class _Req:  # what the Drafter reads of an engine Request (one growing token list, as there)
    request_id: str
    all_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    def append(self, tokens: list[int]) -> None:
        self.all_token_ids.extend(tokens)
        self.output_token_ids.extend(tokens)


def record(a: argparse.Namespace) -> None:
    from baton import LLM, SamplingParams

    ns = argparse.Namespace(block_tokens=None, max_context_tokens=a.max_context_tokens,
                            max_output_tokens=128, time_scale=1.0, max_think_time=10.0,
                            max_sessions=a.sessions, max_turns=None, workload=a.workload,
                            trace=None, think_time=1.0)
    counter = TokenCounter.for_model(a.model)
    sessions = load_workload(ns, counter)
    work = {}  # session name -> [(prompt ids, max_tokens)], cut before the first too long
    for s in sessions:
        ends = [len(t.messages) for t in s.turns]
        prompts = counter.chat_prompts(list(s.turns[-1].messages), ends, list(s.tools) or None)
        for t, p in zip(s.turns, prompts):
            if len(p) + t.max_tokens > a.max_context_tokens:
                break
            work.setdefault(s.name, []).append(([int(x) for x in p], t.max_tokens))
    llm = LLM(a.model, dtype="float32", kv_cache_memory_bytes=2 << 30)
    rows = []
    for j in range(max(len(w) for w in work.values())):
        batch = [(name, w[j], j == len(w) - 1) for name, w in work.items() if j < len(w)]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for _, (_, n), _ in batch]
        outs = llm.generate([p for _, (p, _), _ in batch], params)
        for (name, (p, _), last), o in zip(batch, outs):
            rows.append({"session": name, "turn": j, "last": last, "prompt": p,
                         "output": o.outputs[0].token_ids})
        print(f"turn {j}: {len(batch)} requests", flush=True)
    order = list(work)
    rows.sort(key=lambda r: (order.index(r["session"]), r["turn"]))
    with open(a.out, "w") as f:
        json.dump(rows, f)


def replay(a: argparse.Namespace) -> None:
    rows = json.load(open(a.file))
    cost = [float(c) for c in a.cost.split(",")]
    cfg = SpeculativeConfig(method=a.method, num_speculative_tokens=a.k,
                            min_match_tokens=a.min_match, max_spec_factor=a.factor)
    drafter = Drafter(cfg)
    steps = drafted_steps = drafted = accepted = 0
    plain_total = spec_total = 0.0
    ratios = []
    for i, r in enumerate(rows):
        req, out = _Req(f"r{i}", list(r["prompt"])), r["output"]
        drafter.add(req.request_id, r["session"], r["last"])
        req.append(out[:1])  # the prefill's token
        t = 0.0
        while len(req.output_token_ids) < len(out):
            room = min(a.k, len(out) - len(req.output_token_ids) - 1)
            d = drafter.propose(req, room) if room > 0 else []
            n = len(req.output_token_ids)
            acc = 0
            while acc < len(d) and d[acc] == out[n + acc]:
                acc += 1
            if d:
                drafter.observe(req.request_id, len(d), acc)
                drafted_steps, drafted, accepted = drafted_steps + 1, drafted + len(d), accepted + acc
            req.append(out[n:n + acc + 1])
            steps += 1
            t += cost[min(len(d), len(cost) - 1)]
        drafter.finish(req)
        plain = len(out) - 1
        if plain:
            plain_total, spec_total = plain_total + plain, spec_total + t
            ratios.append(plain / t)
    print(f"{a.method} k={a.k} min_match={a.min_match} factor={a.factor}: {len(rows)} requests, "
          f"{steps} steps, {drafted_steps / max(steps, 1):.0%} with a draft, acceptance "
          f"{accepted / max(drafted, 1):.0%} ({accepted}/{drafted}), "
          f"{(steps + accepted) / max(steps, 1):.2f} tokens/step; predicted speed-up "
          f"{plain_total / spec_total:.2f}x overall, {median(ratios):.2f}x median per request")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--workload", choices=("tau-bench", "swe-agent"), default="tau-bench")
    r.add_argument("--sessions", type=int, default=12)
    r.add_argument("--max-context-tokens", type=int, default=4096)
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay")
    p.add_argument("file")
    p.add_argument("--method", default="suffix", choices=("suffix", "ngram"))
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--min-match", type=int, default=3)
    p.add_argument("--factor", type=float, default=1.0)
    p.add_argument("--cost", default=COST)
    a = ap.parse_args()
    record(a) if a.cmd == "record" else replay(a)


if __name__ == "__main__":
    main()
