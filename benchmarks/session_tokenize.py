"""Gateway tokenization per agent turn: incremental (gateway/session_tokens.py) vs. a full
re-tokenization, on one growing conversation, measured in the same run.

    python benchmarks/session_tokenize.py                     # SmolLM2-135M, 32k tokens
    python benchmarks/session_tokenize.py --model FOLDER --context-tokens 65536

The conversation is the shipped SWE-agent trajectories' messages (baton/bench/traces),
replayed in order and cycled until the rendered prompt reaches --context-tokens: each turn
adds the model's reply and a tool result, as an agent's next request does. Every turn's
prompt is rendered once through the gateway's chat template (the time is printed apart:
`render`), then tokenized both ways, alternating which goes first:
- full:        PieceTokenizer without its cache (= `tokenizer.encode`, the Rust tokenizer)
- incremental: PromptBuilder.sessions.encode(session, text): turn k's ids up to the last
               safe added-token boundary + the new suffix's ids
Both must give the same ids on every turn (the run stops otherwise). Prints p50/p90 per turn
over the turns whose context is at least --measure-from tokens (default: half the context).
Target (issue 25): incremental p50 <= 5 ms at 32k tokens.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gateway.prompts import PromptBuilder  # noqa: E402

TRACES = REPO / "baton" / "bench" / "traces" / "swe_agent_trajectories"


def trace_messages() -> list[dict]:
    """Every SWE-agent trajectory's history (user/assistant text), in file order."""
    out = []
    for path in sorted(TRACES.glob("*.traj.gz")):
        with gzip.open(path, "rt") as f:
            history = json.load(f).get("history") or []
        for m in history:
            content = m.get("content")
            if m.get("role") in ("user", "assistant") and isinstance(content, str) and content:
                out.append({"role": m["role"], "content": content})
    if not out:
        raise SystemExit(f"no messages under {TRACES}")
    return out


def turns(builder: PromptBuilder, target: int, source: list[dict]):
    """Yield (rendered text, render seconds) per turn; the caller stops at `target` tokens
    (a bound of 8 chars a token ends it anyway)."""
    messages = [{"role": "system", "content": "You are a coding agent."}]
    k = 0
    while True:
        for _ in range(2):  # the reply, then the tool result (a user turn), alternating roles
            m = dict(source[k % len(source)])
            m["role"] = "assistant" if messages[-1]["role"] != "assistant" else "user"
            messages.append(m)
            k += 1
        if messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": "continue"})
        t0 = time.perf_counter()
        text = builder.tokenizer.apply_chat_template(
            messages, chat_template=builder.chat_template, add_generation_prompt=True,
            tokenize=False)
        render_s = time.perf_counter() - t0
        yield text, render_s
        if len(text) > target * 8:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model id or folder")
    ap.add_argument("--context-tokens", type=int, default=32768)
    ap.add_argument("--measure-from", type=int, default=None,
                    help="tokens from which turns count (default: context/2)")
    args = ap.parse_args()
    from baton.models.registry import resolve_model
    folder = Path(args.model) if Path(args.model).is_dir() else resolve_model(args.model)
    builder = PromptBuilder.from_folder(folder)
    full = builder.encoder
    if not full.enabled:
        raise SystemExit("this tokenizer's piece cache is off: incremental = full")
    measure_from = args.measure_from or args.context_tokens // 2
    rows = []  # (tokens, render, full, incremental)
    for turn, (text, render_s) in enumerate(turns(builder, args.context_tokens,
                                                     trace_messages())):
        timings = {}
        order = ("full", "incr") if turn % 2 == 0 else ("incr", "full")
        for which in order:
            t0 = time.perf_counter()
            if which == "full":
                ids_full = list(builder.tokenizer.encode(text, add_special_tokens=False))
            else:
                ids_incr = builder.sessions.encode("bench", text)
            timings[which] = time.perf_counter() - t0
        if ids_full != ids_incr:
            raise SystemExit(f"turn {turn}: incremental ids differ from a full tokenization")
        rows.append((len(ids_full), render_s, timings["full"], timings["incr"]))
        if len(ids_full) >= args.context_tokens:
            break
    kept = [r for r in rows if r[0] >= measure_from]
    if not kept:
        raise SystemExit("the conversation never reached --measure-from tokens")

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    print(f"model {folder.name}  turns {len(rows)} (measured {len(kept)}: "
          f"{kept[0][0]}..{kept[-1][0]} tokens)  load {os.getloadavg()[0]:.2f}")
    print("ids identical on every turn: yes")
    print(f"{'per turn, ms':<22}{'p50':>9}{'p90':>9}")
    for name, col in (("render (template)", 1), ("full tokenize", 2), ("incremental", 3)):
        vals = [r[col] for r in kept]
        print(f"{name:<22}{pct(vals, 0.5):>9.2f}{pct(vals, 0.9):>9.2f}")
    ratio = statistics.median(r[2] / max(r[3], 1e-9) for r in kept)
    print(f"full / incremental, median of per-turn ratios: {ratio:.1f}x")


if __name__ == "__main__":
    main()
