"""How close two greedy runs of one model are when they cannot be token-exact (bf16 against
another implementation's bf16): vLLM's `check_logprobs_close` rule (tests/models/utils.py in
vLLM), shared by the bf16 tests and benchmarks/gpu_check.py.

Per prompt: the greedy tokens agree at every position up to the first divergence; at the
divergence each side's token is among the other side's top-k at that position, and the check
stops there (after a divergence the two runs continue from different prefixes).
"""
from __future__ import annotations

from collections.abc import Sequence

# one run of one prompt: its greedy tokens and, per position, the ids of its top-k there
Run = tuple[Sequence[int], Sequence[set[int]]]


def check_logprobs_close(outputs_0: Sequence[Run], outputs_1: Sequence[Run], name_0: str,
                         name_1: str, top: int = 5) -> int:
    """Apply the rule to each prompt's pair of runs; returns how many prompts agreed on every
    token. AssertionError naming the prompt and position where a divergence breaks the rule
    (a token outside the other side's top-`top`), or where the runs' lengths differ."""
    assert len(outputs_0) == len(outputs_1), f"{len(outputs_0)} prompts vs {len(outputs_1)}"
    exact = 0
    for i, ((ids_0, top_0), (ids_1, top_1)) in enumerate(zip(outputs_0, outputs_1)):
        assert len(ids_0) == len(ids_1), f"prompt {i}: {len(ids_0)} tokens vs {len(ids_1)}"
        for pos, (a, b) in enumerate(zip(ids_0, ids_1)):
            if a != b:
                where = f"prompt {i} position {pos}"
                assert a in top_1[pos], f"{where}: {name_0} {a} not in {name_1}'s top-{top}"
                assert b in top_0[pos], f"{where}: {name_1} {b} not in {name_0}'s top-{top}"
                break
        else:
            exact += 1
    return exact
