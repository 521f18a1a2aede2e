"""`baton bench compare --rounds N`: the configurations run N times, the order reversed every
other round, and each configuration's key numbers per round beside its reference's.

On one machine the order of a compare run moves the result: in BENCHMARKS.md's AgentX runs
the default cluster always ran first, and paired per turn its TTFT over colocated's was 1.17
with the default first and 1.00 with it second (issue 28). Round r runs the configurations in
the given order when r is even and reversed when odd (A B C, C B A, A B C...), so each one runs
first as often as the others (for an even N) and each pair is measured in both orders.

Per configuration and round: TTFT p50 and p90, ITL p90 (ms) and output tokens/s, the AgentX
harness's own numbers under `--driver agentx`, else Baton's client's; and the rounds in which
it did better than its reference on each (lower latency, higher throughput; a tie is not
better). Written to rounds.json beside each round's folder and printed as one table.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms", "out_tok_s")


def round_order(targets: Sequence, index: int) -> list:
    """Round `index` (0-based): `targets` as given when even, reversed when odd."""
    return list(targets) if index % 2 == 0 else list(reversed(targets))


def key_numbers(row) -> dict[str, float | None]:
    """TTFT p50/p90 and ITL p90 in ms and output tok/s of one compare.Row: the harness's
    aggregate when it has one, else the client's Summary. None where a number is missing."""
    src = row.harness if row.harness is not None else row.summary

    def ms(x):
        return None if x is None else x * 1e3
    return {"ttft_p50_ms": ms(src.ttft.p50), "ttft_p90_ms": ms(src.ttft.p90),
            "itl_p90_ms": ms(src.itl.p90), "out_tok_s": src.output_tokens_per_s}


def _better(metric: str, ours: float | None, ref: float | None) -> bool:
    if ours is None or ref is None:
        return False
    return ours > ref if metric == "out_tok_s" else ours < ref


@dataclass
class RoundsRow:
    """One configuration over the rounds: its numbers per round (dicts of METRICS) and, where
    it has a reference that ran in the same round, how many rounds it beat it per metric."""
    name: str
    reference: str | None
    per_round: list[dict[str, float | None] | None]
    wins: dict[str, int]
    compared: int


def summarize(rounds: Sequence[dict]) -> list[RoundsRow]:
    """rounds: per round, compare.Row objects by configuration name (the order of the
    first round's keys is kept) → one RoundsRow per configuration."""
    names = list(dict.fromkeys(name for rows in rounds for name in rows))
    out = []
    for name in names:
        per_round, wins, compared, reference = [], dict.fromkeys(METRICS, 0), 0, None
        for rows in rounds:
            row = rows.get(name)
            per_round.append(key_numbers(row) if row is not None else None)
            if row is None or row.reference is None or row.reference not in rows:
                continue
            reference = row.reference
            ours, ref = per_round[-1], key_numbers(rows[row.reference])
            compared += 1
            for m in METRICS:
                wins[m] += _better(m, ours[m], ref[m])
        out.append(RoundsRow(name, reference, per_round, wins, compared))
    return out


def to_json(rows: list[RoundsRow], orders: list[list[str]]) -> dict:
    """rounds.json: the order of each round and every configuration's numbers and wins."""
    return {"orders": orders, "configs": [
        {"name": r.name, "reference": r.reference, "per_round": r.per_round,
         "wins": r.wins if r.compared else None, "rounds_compared": r.compared}
        for r in rows]}


def print_rounds(rows: list[RoundsRow], orders: list[list[str]], title: str) -> None:
    """One table: per configuration and round `p50/p90 ms, ITL p90 ms, tok/s`, then the
    rounds it beat its reference (TTFT p50, p90, ITL p90, tok/s)."""
    from rich.table import Table

    from baton.bench.report import console

    caption = "orders: " + "; ".join(" ".join(o) for o in orders)
    table = Table(title=title, caption=caption)
    table.add_column("config")
    for i in range(len(orders)):
        table.add_column(f"round {i + 1}: TTFT p50/p90, ITL p90 ms, tok/s", justify="right")
    table.add_column("vs")
    table.add_column("rounds better: p50 / p90 / ITL p90 / tok/s", justify="right")

    def cell(n):
        if n is None:
            return "-"
        f = [("-" if n[m] is None else f"{n[m]:.0f}") for m in METRICS[:3]]
        tok = "-" if n["out_tok_s"] is None else f"{n['out_tok_s']:.1f}"
        return f"{f[0]}/{f[1]}, {f[2]}, {tok}"
    for r in rows:
        wins = (" / ".join(f"{r.wins[m]}/{r.compared}" for m in METRICS) if r.compared
                else "")
        table.add_row(r.name, *map(cell, r.per_round), r.reference or "", wins)
    console().print(table)
