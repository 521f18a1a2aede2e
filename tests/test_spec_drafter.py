"""Drafting for speculative decoding (baton/engine/spec/): the token index against brute
force, the drafter's sources, lengths and bounds. No model."""
from __future__ import annotations

import random

import pytest

from baton.config import SpeculativeConfig
from baton.engine.request import Request
from baton.engine.spec.drafter import Drafter
from baton.engine.spec.sessions import RecentOutputs, SessionIndices, common_prefix
from baton.engine.spec.token_index import TokenIndex
from baton.sampling_params import SamplingParams


def _brute_longest(tokens, query, max_match, max_chain=8):
    """Reference: the same answer by scanning every position (latest first)."""
    q_end = len(query) - 1
    best = (0, -1)
    tried = 0
    for p in range(len(tokens) - 2, 0, -1):
        if tokens[p - 1:p + 1] != query[q_end - 1:q_end + 1] or (tokens is query and p >= q_end):
            continue
        tried += 1
        if tried > max_chain:
            break
        m = 0
        while m < max_match and p - m >= 0 and q_end - m >= 0 and tokens[p - m] == query[q_end - m]:
            m += 1
        if m > best[0]:
            best = (m, p)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_longest_match_equals_brute_force(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(30, 300))]
    idx = TokenIndex(tokens)
    idx.index_to(len(tokens) - 1)
    for max_match in (2, 5, 64):
        assert idx.longest_match(tokens, max_match) == _brute_longest(tokens, tokens, max_match)
    other = [rng.randrange(4) for _ in range(40)]
    assert idx.longest_match(other, 16) == _brute_longest(tokens, other, 16)


@pytest.mark.parametrize("seed", range(4))
def test_bulk_and_one_by_one_filing_agree(seed):
    """numpy filing (whole prompts) and the per-token loop (outputs) build the same chains,
    in any mix, separators included."""
    rng = random.Random(seed)
    tokens = [rng.choice([-1, 0, 1, 2, 3, 4]) for _ in range(500)]
    one = TokenIndex(tokens)
    for end in range(1, len(tokens) + 1):
        one.index_to(end)
    mixed = TokenIndex(tokens)
    for end in (70, 75, 200, 201, 500):
        mixed.index_to(end)
    bulk = TokenIndex(tokens)
    bulk.index_to(500)
    assert one.head == mixed.head == bulk.head
    assert list(one.prev) == list(mixed.prev) == list(bulk.prev)


def test_continuation_copies_its_own_period_past_the_end():
    tokens = [9, 1, 2, 3, 1, 2, 3, 1, 2]
    idx = TokenIndex(tokens)
    idx.index_to(len(tokens) - 1)
    m, p = idx.longest_match(tokens, 64)
    assert (m, p) == (5, 5)  # 1 2 3 1 2 ending at position 5
    assert idx.continuation(p, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert TokenIndex([5, 6, -1, 7]).continuation(0, 5) == [6]  # stops at a separator


@pytest.mark.parametrize("cut", [0, 1, 2, 57, 120, 200])
def test_copy_onto_a_diverging_list_equals_a_fresh_index(cut):
    rng = random.Random(cut)
    old = [rng.randrange(5) for _ in range(200)]
    new = old[:cut] + [rng.randrange(5) for _ in range(100)]
    base = TokenIndex(old)
    base.index_to(200)
    cont = base.copy_onto(new, cut)
    cont.index_to(len(new))
    fresh = TokenIndex(new)
    fresh.index_to(len(new))
    assert cont.head == fresh.head and list(cont.prev) == list(fresh.prev)
    again = TokenIndex(old)
    again.index_to(200)
    assert base.head == again.head  # the session's own index is left as it was


def test_common_prefix():
    a = list(range(1000))
    assert common_prefix(a, a + [1], 2000) == 1000
    assert common_prefix(a, a[:600] + [-5] + a[601:], 2000) == 600
    assert common_prefix(a, a, 10) == 10 and common_prefix([], a, 5) == 0


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=50), 50)


def _drafter(**kw) -> Drafter:
    return Drafter(SpeculativeConfig(method=kw.pop("method", "suffix"), **kw))


def test_nothing_repeated_drafts_nothing():
    d = _drafter()
    req = _req("a", list(range(100, 200)))
    d.add("a", None)
    assert d.propose(req, 8) == []
    req.append_output_token(150)  # one token of the prompt again: no 3-token match
    assert d.propose(req, 8) == []


def test_a_repeated_span_drafts_what_followed_it_up_to_the_match_length():
    d = _drafter(num_speculative_tokens=8)
    code = list(range(100, 140))
    req = _req("a", [1, 2] + code + [7, 8] + code[:3])
    d.add("a", None)
    assert d.propose(req, 8) == code[3:6]  # match of 3 tokens: draft ≤ 3 (max_spec_factor 1)
    for t in code[3:9]:
        req.append_output_token(t)
    assert d.propose(req, 8) == code[9:17]  # a 9-token match: the full 8
    assert d.propose(req, 2) == code[9:11]  # the engine's cap


def test_draft_length_follows_acceptance():
    d = _drafter(num_speculative_tokens=8)
    code = list(range(100, 140))
    req = _req("a", code + [7] + code[:20])
    d.add("a", None)
    assert len(d.propose(req, 8)) == 8
    d.observe("a", 8, 2)
    assert len(d.propose(req, 8)) == 3  # accepted + 1
    d.observe("a", 3, 3)
    assert len(d.propose(req, 8)) == 6  # doubled
    d.observe("a", 6, 0)
    assert len(d.propose(req, 8)) == 1


def test_ngram_uses_the_request_only_with_a_fixed_length():
    d = _drafter(method="ngram", num_speculative_tokens=4)
    code = list(range(100, 140))
    req = _req("a", code + [7] + code[:3])
    d.add("a", None)
    assert d.propose(req, 8) == code[3:7]  # not capped by the 3-token match
    d.observe("a", 4, 0)
    assert d.propose(req, 8) == code[3:7]  # no adaptation
    d.finish(req)
    assert len(d.recent.index.tokens) == 0 and len(d.sessions) == 0


def test_a_session_turn_continues_its_index_and_sees_earlier_turns():
    d = _drafter()
    turn1 = list(range(100, 130))
    r1 = _req("t1", turn1)
    d.add("t1", "s")
    d.propose(r1, 8)
    for t in [50, 51, 52, 53, 54, 55]:
        r1.append_output_token(t)
    d.finish(r1)
    assert len(d.sessions) == 1 and d.sessions.num_tokens == 36
    # turn 2 continues turn 1 (prompt = its context + output + more): the index is continued
    r2 = _req("t2", r1.all_token_ids + [60, 50, 51, 52])
    d.add("t2", "s")
    assert d.propose(r2, 8) == [53, 54, 55]
    # a retried turn whose prompt diverges early: turn 1's tokens still draft (the side index)
    r3 = _req("t3", [1, 2, 3, 50, 51, 52])
    d.add("t3", "s")
    assert d.propose(r3, 8) == [53, 54, 55]
    # another session sees nothing of "s" but the recent outputs
    r4 = _req("t4", [9, 9, 9, 8, 51, 52, 53])
    d.add("t4", "other")
    assert d.propose(r4, 8) == [54, 55]


def test_session_and_recent_memory_is_bounded():
    s = SessionIndices(max_tokens=100)
    for i in range(5):
        idx = TokenIndex(list(range(i, i + 40)))
        idx.index_to(40)
        s.put(f"s{i}", idx)
    assert len(s) == 2 and s.num_tokens == 80  # LRU: the last two
    s.drop("s4")
    assert len(s) == 1 and s.num_tokens == 40
    r = RecentOutputs(max_tokens=64)
    for i in range(20):
        r.add(list(range(i * 10, i * 10 + 10)))
        assert len(r.index.tokens) <= 64 and r.index.num_indexed == len(r.index.tokens)


def test_synthetic_mode_always_drafts_the_full_length():
    d = _drafter(synthetic_acceptance=(0.5,), num_speculative_tokens=4)
    req = _req("a", list(range(100, 120)))
    d.add("a", None)
    assert d.propose(req, 8) == [119] * 4
    d.observe("a", 4, 0)
    assert len(d.propose(req, 8)) == 4


def test_config_validation():
    with pytest.raises(ValueError):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError):
        SpeculativeConfig(synthetic_acceptance=(0.5,))  # needs a method
    with pytest.raises(ValueError):
        SpeculativeConfig(method="suffix", synthetic_acceptance=(0.5, 0.7))
    c = SpeculativeConfig(method="suffix", num_speculative_tokens=3, synthetic_acceptance=(0.5,))
    assert c.acceptance_rates() == (0.5, 0.25, 0.125)
