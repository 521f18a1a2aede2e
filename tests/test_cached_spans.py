"""Where a request's cached prompt tokens came from (baton/engine/kv_source.py): the pool and
each KV tier, counted at admission; their sum is exactly the prompt tokens the engine did
not compute for the request."""
import random

from baton import LLM, SamplingParams
from baton.engine.kv_source import KVSource, skip, spans_of, take, total

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 4
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny Llama: 2 layers, K/V, 2 kv heads, head size 16
P, H, D = KVSource.POOL, KVSource.HOST_TIER, KVSource.DISK_TIER


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_spans_cut_anywhere():
    spans = spans_of([P, P, H, H, D], 16)
    assert spans == ((P, 32), (H, 32), (D, 16))
    assert take(spans, 40) == ((P, 32), (H, 8)) and skip(spans, 40) == ((H, 24), (D, 16))
    assert take(spans, 500) == spans and skip(spans, 500) == () and skip(spans, 0) == spans
    assert total(take(spans, 40)) + total(skip(spans, 40)) == total(spans) == 80


def _computed_prompt_tokens(llm: LLM) -> dict[str, int]:
    """Count, per request, the prompt tokens the engine's steps compute."""
    counted: dict[str, int] = {}
    schedule = llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        for s in out[0]:
            r = s.request
            prompt_part = max(0, min(r.num_computed_tokens + s.num_new_tokens,
                                     r.num_prompt_tokens) - r.num_computed_tokens)
            counted[r.request_id] = counted.get(r.request_id, 0) + prompt_part
        return out

    llm.engine.scheduler.schedule = counting
    return counted


def test_split_by_pool_and_host_tier_sums_to_tokens_not_computed(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=BS, num_blocks=24,
              kv_host_tier_bytes=64 * BLOCK_BYTES, dtype="float32")
    computed = _computed_prompt_tokens(llm)
    turn1 = _ids(30, seed=1)
    (out1,) = llm.generate([turn1], GREEDY)
    assert out1.cached_spans == () and computed["0"] == 30
    (again,) = llm.generate([turn1], GREEDY)  # in the pool: 7 full blocks (one token left)
    assert again.cached_spans == ((P, 28),) and computed["1"] == 30 - 28
    for seed in (2, 3):  # push turn 1 out of the pool into the host tier
        llm.generate([_ids(60, seed)], GREEDY)
    turn2 = turn1 + out1.outputs[0].token_ids + _ids(6, seed=4)
    (out2,) = llm.generate([turn2], GREEDY)
    by = dict(out2.cached_spans)
    assert by.get(H, 0) >= 28 and total(out2.cached_spans) == out2.num_cached_tokens
    assert out2.num_cached_tokens == len(turn2) - computed["4"]
    counts = dict(llm.engine.counts().cached_tokens_by_source)
    assert counts[H] == by[H] and counts[P] == 28 + by.get(P, 0) and counts[D] == 0
    (out3,) = llm.generate([turn2], GREEDY)  # now in the pool: no tier counted twice
    assert out3.cached_spans == ((P, out3.num_cached_tokens),)
    assert out3.num_cached_tokens == len(turn2) - computed["5"]
