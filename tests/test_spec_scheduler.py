"""Decode rows with drafted tokens on a bare Scheduler + KVCacheManager (no model): the
budget, the pool and the prefix cache (see test_scheduler.py for the helpers)."""
from baton.engine.request import RequestStatus
from tests.test_scheduler import _req, _rows, _scheduler, _step, _tables


def _decoding(s, rid, prompt, max_tokens=8):
    req = _req(rid, prompt, max_tokens=max_tokens)
    s.add(req)
    _step(s)  # its prompt: one token out, a decode row from now on
    return req


def test_drafts_ride_the_decode_row_within_the_budget():
    """Budget 7, two decode rows with 4 drafts each: one token is kept for every decode row
    after the first, the rest of the budget goes to drafts in admission order."""
    s = _scheduler(32, max_num_batched_tokens=7)
    a, b = _decoding(s, "a", [3, 4, 5]), _decoding(s, "b", [6, 7, 8])
    a.spec_token_ids, b.spec_token_ids = [10, 11, 12, 13], [20, 21, 22, 23]
    out = s.schedule()
    assert [(r.request.request_id, r.num_new_tokens, r.spec_token_ids) for r in out.scheduled] \
        == [("a", 5, (10, 11, 12, 13)), ("b", 2, (20,))]
    # a: 5 tokens (2 out), its row writes positions 4..8; b: 4 tokens, positions 3..4
    assert _tables(out) == {"a": [0, 2, 3], "b": [1, 4]}
    assert all(r.completes_prompt for r in out.scheduled)


def test_drafts_never_preempt_anyone():
    """A full pool: a's decode fits its last block but its drafts would need another; they
    are dropped, b (admitted later) keeps running."""
    s = _scheduler(2, long_prefill_token_threshold=0)
    a = _decoding(s, "a", [3, 4])
    b = _decoding(s, "b", [6, 7])  # a has 4 tokens now, its next position ends block 0
    a.spec_token_ids = [10, 11]
    out = s.schedule()
    assert out.preempted == [] and b.status is RequestStatus.RUNNING
    assert [(r.request.request_id, r.num_new_tokens, r.spec_token_ids) for r in out.scheduled] \
        == [("a", 1, ()), ("b", 1, ())]


def test_a_draft_row_is_not_an_inflight_prefix():
    """A decode row's drafts are guesses: a waiting request whose next block they would
    fill is not deferred for them (only prefill rows' blocks count)."""
    s = _scheduler(32, block_size=4)
    a = _decoding(s, "a", [3, 4, 5, 6, 7, 8, 9])  # 8 tokens: its decode row fills block 1
    a.spec_token_ids = [40, 41, 42]
    s.add(_req("c", [3, 4, 5, 6, 7, 8, 9, 1, 40, 41, 42, 50]))
    assert _rows(s.schedule()) == [("a", 4), ("c", 8)]


def test_trim_releases_only_blocks_past_the_tokens():
    s = _scheduler(8, block_size=4)
    a = _decoding(s, "a", [3, 4, 5])  # 4 tokens
    assert s.kv.allocate_slots("a", 4 + 6) is not None  # a row of 1 + 6 drafts: 3 blocks
    assert s.kv.block_table("a") == [0, 1, 2]
    assert s.kv.trim("a", 5) == 1  # 5 tokens kept (one draft accepted): 2 blocks
    assert s.kv.block_table("a") == [0, 1] and s.kv.num_free_blocks == 6
    assert s.kv.pool.free_queue and next(iter(s.kv.pool.free_queue)) == 2  # head: reused first
    assert s.kv.trim("a", 5) == 0 and a.status is RequestStatus.RUNNING


def test_drafts_take_only_blocks_no_running_request_needs():
    """A 4-block pool: d decodes (block 0) while p's 8-token prompt runs in chunks of 4 (block
    1, one more to come). d's 5 drafts may fill its own block and one spare block, never the
    block p's next chunk needs: d carries 4, p runs, nobody is preempted."""
    s = _scheduler(4, long_prefill_token_threshold=4)
    d = _decoding(s, "d", [3, 4])
    p = _req("p", list(range(10, 18)), max_tokens=2)
    s.add(p)
    assert _rows(_step(s)) == [("d", 1), ("p", 4)]
    d.spec_token_ids = [9, 9, 9, 9, 9]
    out = s.schedule()
    assert _rows(out) == [("d", 5), ("p", 4)] and out.preempted == []
    assert out.scheduled[0].spec_token_ids == (9, 9, 9, 9) and s.kv.num_free_blocks == 0
