"""The trace slices shipped in the package replay with no file beside the clone, and a
missing trace is a one-line error naming the flag."""
import argparse

import pytest

from baton.bench.args import DEFAULT_TRACE, TRACES, add_workload_args, load_workload
from baton.bench.tokens import TokenCounter


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("workload", sorted(DEFAULT_TRACE))
def test_every_default_workload_loads_its_shipped_slice(workload):
    assert (TRACES / DEFAULT_TRACE[workload]).exists()
    sessions = load_workload(_args("--workload", workload, "--max-sessions", "4",
                                   "--max-context-tokens", "4096"), TokenCounter(None))
    assert sessions and all(s.turns for s in sessions)


def test_tau_bench_slice_has_room_for_the_documented_runs():
    sessions = load_workload(_args("--workload", "tau-bench", "--max-sessions", "32"),
                             TokenCounter(None))
    assert len(sessions) == 32


def test_a_missing_trace_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--trace"):
        load_workload(_args("--workload", "mooncake", "--trace", str(tmp_path / "nope.jsonl")),
                      TokenCounter(None))
