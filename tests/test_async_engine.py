"""The engine thread bridge: streaming, abort on early exit, bad input, step failures."""
import asyncio

import pytest

from baton import LLM, SamplingParams
from baton.worker.async_engine import AsyncEngine
from tests.reference import hf_greedy


@pytest.fixture
def engine(tiny_llama):
    return LLM(str(tiny_llama), block_size=8, num_blocks=64, dtype="float32").engine


async def test_concurrent_streams_match_reference(engine, tiny_llama):
    ae = AsyncEngine(engine)
    ae.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]

        async def run(i, p):
            return [t async for out in ae.generate(f"r{i}", p, params) for t in out.new_token_ids]

        results = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        for p, r in zip(prompts, results):
            assert r == hf_greedy(tiny_llama, p, 6)
    finally:
        ae.shutdown()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


async def test_consumer_leaving_early_aborts_and_frees(engine):
    ae = AsyncEngine(engine)
    ae.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        gen = ae.generate("r", list(range(3, 40)), params)
        await gen.__anext__()
        await gen.aclose()
        assert await ae.call(lambda e: e.kv.num_free_blocks) == engine.kv.num_blocks
        assert not engine.requests
    finally:
        ae.shutdown()


async def test_bad_request_raises_and_engine_keeps_serving(engine):
    ae = AsyncEngine(engine)
    ae.start()
    try:
        with pytest.raises(ValueError):
            async for _ in ae.generate("bad", [], SamplingParams()):
                pass
        outs = [o async for o in ae.generate("ok", [5, 6, 7], SamplingParams(max_tokens=2))]
        assert outs[-1].finished
    finally:
        ae.shutdown()


async def test_step_failure_fails_requests_not_the_loop(engine, monkeypatch):
    ae = AsyncEngine(engine)
    ae.start()
    try:
        real = engine.runner.execute
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return real(batch)

        monkeypatch.setattr(engine.runner, "execute", flaky)
        outs = [o async for o in ae.generate("a", [5, 6, 7], SamplingParams(max_tokens=3))]
        assert outs[-1].finish_reason == "error" and "boom" in outs[-1].error
        outs = [o async for o in ae.generate("b", [5, 6, 7], SamplingParams(max_tokens=3))]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        ae.shutdown()


async def test_call_with_deliver_queues_the_output_before_returning(engine):
    """RemoteKV.finish's output must reach the stream before any later step's."""
    from baton.outputs import StepOutput

    ae = AsyncEngine(engine)
    ae.start()
    try:
        q = ae.open_stream("x")
        out = StepOutput("x", [7], "", [], False, None, None, 3, 1, 0)
        assert await ae.call(lambda e: out, deliver=True) is out
        assert q.qsize() == 1 and q.get_nowait() is out
    finally:
        ae.close_stream("x")
        ae.shutdown()


async def _serve_three(ae: AsyncEngine) -> dict[str, list]:
    """'a', 'poison', 'b' added in one engine call, so one step admits all three."""
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rids = ("a", "poison", "b")
    queues = {rid: ae.open_stream(rid) for rid in rids}
    await ae.call(lambda e: [e.add_request(rid, [5, 6, 7, i], p) for i, rid in enumerate(rids)])

    async def run(rid: str) -> list:
        try:
            return [o async for o in ae.stream(rid, queues[rid])]
        finally:
            ae.close_stream(rid)

    outs = await asyncio.wait_for(asyncio.gather(*(run(rid) for rid in rids)), 30)
    return dict(zip(rids, outs))


@pytest.mark.parametrize("where", ["admission", "token"])
async def test_one_poisoned_request_fails_alone(engine, monkeypatch, where):
    """Case 11's rule inside the engine: a fault only one request hits (its admission, or the
    processing of its sampled token) ends that request with an error; the requests batched
    with it are served in full, nothing leaks, and the loop keeps stepping."""
    import baton.engine.llm_engine as llm_engine

    target, name = (engine.kv, "get_computed_blocks") if where == "admission" \
        else (llm_engine, "check_stop")
    real = getattr(target, name)

    def poisoned(first, *rest):  # (request_id, ...) or (request, detok, token, ...)
        rid = first if where == "admission" else first.request_id
        if rid == "poison":
            raise RuntimeError("boom")
        return real(first, *rest)

    monkeypatch.setattr(target, name, poisoned)
    ae = AsyncEngine(engine)
    ae.start()
    try:
        outs = await _serve_three(ae)
        assert outs["poison"][-1].finish_reason == "error" and "boom" in outs["poison"][-1].error
        for rid in ("a", "b"):
            assert outs[rid][-1].finish_reason == "length", rid
            assert sum(len(o.new_token_ids) for o in outs[rid]) == 3
        assert await ae.call(lambda e: e.kv.num_free_blocks) == engine.kv.num_blocks
        assert not engine.requests and not engine.scheduler.has_unfinished()
    finally:
        ae.shutdown()
