"""The seeded AgentX-like generator."""
from baton.bench.synthetic import SyntheticConfig, generate
from baton.bench.workload import Scaling


def test_deterministic_in_seed():
    a = generate(SyntheticConfig(sessions=6, seed=3), Scaling())
    b = generate(SyntheticConfig(sessions=6, seed=3), Scaling())
    c = generate(SyntheticConfig(sessions=6, seed=4), Scaling())
    assert a == b and a != c


def test_shape_growth_sharing_and_fanout():
    sessions = generate(SyntheticConfig(sessions=20, subagent_prob=0.5, seed=1),
                        Scaling(max_output_tokens=32, time_scale=0.5, max_think_s=3.0))
    assert len(sessions) == 20
    system = sessions[0].turns[0].block_ids[: 1024 // 64]
    for s in sessions:
        assert s.turns[0].block_ids[: len(system)] == system  # one shared system prompt
        for a, b in zip(s.turns, s.turns[1:]):
            assert b.num_tokens > a.num_tokens  # contexts grow every turn
            full = a.num_tokens // 64
            assert b.block_ids[:full] == a.block_ids[:full]  # ... as a prefix
            assert 0 < b.delay_s <= 3.0
        assert all(t.max_tokens <= 32 for t in s.turns)
    kids = [c for s in sessions for c in s.children]
    assert kids and all(c.join_turn in (None, c.after_turn + 1) for c in kids)
    assert any(c.join_turn is not None for c in kids)
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 0.0


def test_block_tokens_shrinks_prompts():
    big = generate(SyntheticConfig(sessions=3), Scaling())
    small = generate(SyntheticConfig(sessions=3), Scaling(block_tokens=16,
                                                          max_context_tokens=400))
    assert small[0].block_tokens == 16
    assert small[0].turns[0].num_tokens < big[0].turns[0].num_tokens / 2
    assert all(t.num_tokens <= 400 for s in small for t in s.turns)
