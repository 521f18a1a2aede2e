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


def test_bursts_alternate_decoders_and_fresh_long_prompts():
    from baton.bench.synthetic import BurstsConfig, bursts
    sessions = bursts(BurstsConfig(sessions=6, seed=2), Scaling(block_tokens=16))
    assert bursts(BurstsConfig(sessions=6, seed=2), Scaling(block_tokens=16)) == sessions
    decoders, burst = sessions[0::2], sessions[1::2]
    assert [s.name.split("-")[0] for s in sessions] == ["dec", "burst"] * 3
    for s in decoders:
        assert all(t.max_tokens == 64 and t.num_tokens < 400 for t in s.turns)
        for a, b in zip(s.turns, s.turns[1:]):  # a growing private context
            assert b.num_tokens == a.num_tokens + 64 + 32
            assert b.block_ids[: a.num_tokens // 16] == a.block_ids[: a.num_tokens // 16]
    ids = [set(t.block_ids) for s in burst for t in s.turns]
    for s in burst:
        assert all(t.max_tokens == 4 and t.num_tokens > 800 for t in s.turns)
    assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:])  # all fresh
    every = [set(t.block_ids) for s in sessions for t in s.turns]
    assert not (every[0] & set().union(*ids))
