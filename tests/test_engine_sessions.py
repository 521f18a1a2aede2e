"""Session hints on a tiny engine with a host tier: fp32 greedy outputs equal the no-hint run,
a pinned session's turn 2 comes back by prefetch (nothing loaded at admission), aborts in every
state with hints leave the pool, its free lists and the tier whole."""
import random

from baton import LLM, SamplingParams
from baton.session_hints import SessionHint
from tests.test_engine_kv_tier import BLOCK_BYTES, BS, _whole
from tests.test_kv_sessions import check_whole

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _run(llm: LLM, rid: str, prompt: list[int], hint: SessionHint | None) -> list[int]:
    eng = llm.engine
    eng.add_request(rid, prompt, GREEDY, session=hint)
    out: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


def _agent(llm: LLM, hinted: bool) -> list[list[int]]:
    """Two sessions' two turns, with a session-less prompt between that fills the pool."""
    a1, b1 = _ids(30, 1), _ids(30, 2)
    ha = SessionHint("a", ttl_s=60) if hinted else None
    hb = SessionHint("b", ttl_s=0, end=True) if hinted else None
    outs = [_run(llm, "a1", a1, ha), _run(llm, "b1", b1, hb)]
    outs.append(_run(llm, "x", _ids(50, 3), None))
    outs.append(_run(llm, "a2", a1 + outs[0] + _ids(5, 4), ha))
    outs.append(_run(llm, "b2", b1 + outs[1] + _ids(5, 5), hb))
    return outs


def test_greedy_outputs_equal_with_and_without_hints(tiny_llama):
    plain = _agent(LLM(str(tiny_llama), block_size=BS, num_blocks=24, dtype="float32"),
                   hinted=False)
    llm = LLM(str(tiny_llama), block_size=BS, num_blocks=24,
              kv_host_tier_bytes=64 * BLOCK_BYTES, dtype="float32")
    assert _agent(llm, hinted=True) == plain
    kv = llm.engine.kv
    assert kv.prefetched_blocks > 0 and kv.pool.prefetch_hits > 0
    assert "b" in kv.pool.free.ended and not kv.hints
    check_whole(kv.pool)
    _whole(llm)


def test_prefetch_brings_a_pinned_turn_back_before_admission(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=BS, num_blocks=24,
              kv_host_tier_bytes=64 * BLOCK_BYTES, dtype="float32")
    eng, hint = llm.engine, SessionHint("s", ttl_s=60)
    t1 = _ids(30, 1)
    out1 = _run(llm, "t1", t1, hint)
    _run(llm, "x", _ids(70, 3), None)  # 20 blocks: 5 of turn 1's 9 go to the host tier
    host = eng.kv.tier.host_totals
    t2 = t1 + out1 + _ids(5, 4)
    eng.add_request("t2", t2, GREEDY, session=hint)  # arrival: prefetch
    prefetched, loaded = eng.kv.prefetched_blocks, host.loaded_blocks
    assert prefetched == 5
    cached = set()
    while eng.has_unfinished_requests():
        cached |= {o.num_cached_tokens for o in eng.step()}
    assert cached == {9 * BS}  # turn 1's 9 full blocks (prompt + answer) all hit
    assert host.loaded_blocks == loaded  # admission loaded nothing itself
    assert eng.kv.pool.prefetch_hits == prefetched
    _whole(llm)


def test_aborts_in_every_state_with_hints_leave_everything_whole(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=BS, num_blocks=24, kv_host_tier_bytes=8 * BLOCK_BYTES,
              long_prefill_token_threshold=8, dtype="float32")
    eng = llm.engine
    hints = [SessionHint("a", 30), SessionHint("b", 0, end=True), None]
    for k in range(9):  # abort after 0 (waiting), 1-2 (prefilling), 6+ (decoding) steps
        eng.add_request(f"r{k}", _ids(30 + k, k), GREEDY, session=hints[k % 3])
        for _ in range((0, 1, 2, 6)[k % 4]):
            eng.step()
        eng.abort_request(f"r{k}")
        check_whole(eng.kv.pool)
    eng.end_session("a")
    assert not eng.kv.hints and not eng.kv.pool.free.sessions
    check_whole(eng.kv.pool)
    _whole(llm)


async def test_idle_engine_thread_restores_a_pinned_session(tiny_llama):
    import asyncio

    from baton.worker.async_engine import AsyncEngine

    llm = LLM(str(tiny_llama), block_size=BS, num_blocks=24,
              kv_host_tier_bytes=64 * BLOCK_BYTES, dtype="float32")
    ae, hint = AsyncEngine(llm.engine), SessionHint("s", ttl_s=600)
    ae.start()

    async def run(rid, prompt, session):
        q = ae.open_stream(rid)
        await ae.call(lambda e: e.add_request(rid, prompt, GREEDY, session=session))
        out = []
        try:
            while not out or not out[-1].finished:
                out.append(await q.get())
        finally:
            ae.close_stream(rid)
        return [t for o in out for t in o.new_token_ids]

    try:
        t1 = _ids(30, 1)
        out1 = await run("t1", t1, hint)
        await run("x", _ids(70, 3), None)  # 5 of turn 1's 9 blocks evicted while pinned
        for _ in range(500):  # the engine thread restores them once idle
            if await ae.call(lambda e: e.kv.prefetched_blocks) >= 5:
                break
            await asyncio.sleep(0.01)
        assert await ae.call(lambda e: e.kv.prefetched_blocks) == 5
        loaded = llm.engine.kv.tier.host_totals.loaded_blocks
        await run("t2", t1 + out1 + _ids(5, 4), hint)
        assert llm.engine.kv.tier.host_totals.loaded_blocks == loaded
        assert llm.engine.kv.pool.prefetch_hits == 5
    finally:
        ae.shutdown()
    _whole(llm)
