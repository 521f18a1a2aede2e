"""decode_service/usage.py: a request's cached prompt tokens split by source, and the tokens a
prefill worker computed although the decode worker held them (its prefix hit beyond
prefill's); the prompt's part of it on completion 0's first chunk."""
from types import SimpleNamespace

from baton.engine.kv_source import KVSource
from baton.outputs import StepOutput
from baton.sampling_params import SamplingParams
from decode_service.job import Job
from decode_service.metrics import DecodeMetrics
from decode_service.stream import ResponseBuilder
from decode_service.usage import prompt_usage
from protos import common_pb2, prefill_pb2

P, H, D = KVSource.POOL, KVSource.HOST_TIER, KVSource.DISK_TIER
DPOOL, PPOOL = common_pb2.KV_SOURCE_DECODE_POOL, common_pb2.KV_SOURCE_PREFILL_POOL
HOST, DISK = common_pb2.KV_SOURCE_HOST_TIER, common_pb2.KV_SOURCE_DISK_TIER


def _prefill(cached: int, spans=()) -> prefill_pb2.PrefillResponse:
    return prefill_pb2.PrefillResponse(
        num_cached_tokens=cached,
        cached_spans=[common_pb2.CachedTokens(source=s, num_tokens=n) for s, n in spans])


def test_local_prefill_counts_decode_hits_by_source():
    u = prompt_usage(((P, 32), (H, 16), (D, 16)), None)
    assert u == (64, {DPOOL: 32, HOST: 16, DISK: 16}, 0)
    assert prompt_usage((), None) == (0, {}, 0)


def test_remote_prefill_with_a_shorter_hit_recomputes_what_decode_held():
    """The turn-4 case: decode holds 48 (its pool 32, its host tier 16), prefill only 16."""
    u = prompt_usage(((P, 32), (H, 16)), _prefill(16, [(PPOOL, 16)]))
    assert u.cached_tokens == 16 and u.cached_by == {DPOOL: 16}
    assert u.recomputed_held_tokens == 32


def test_remote_prefill_with_a_longer_hit_adds_prefill_sources_after_decode_prefix():
    u = prompt_usage(((P, 16),), _prefill(64, [(PPOOL, 32), (DISK, 32)]))
    assert u.cached_tokens == 64 and u.recomputed_held_tokens == 0
    assert u.cached_by == {DPOOL: 16, PPOOL: 16, DISK: 32}
    assert sum(u.cached_by.values()) == u.cached_tokens
    usage = u.to_proto(prompt_tokens=80, completion_tokens=3)
    assert [(c.source, c.num_tokens) for c in usage.cached_by] == \
        [(DPOOL, 16), (PPOOL, 16), (DISK, 32)]
    assert (usage.cached_tokens, usage.recomputed_held_tokens) == (64, 0)


def test_a_prefill_worker_without_spans_counts_as_its_pool():
    u = prompt_usage((), _prefill(40))
    assert u == (40, {PPOOL: 40}, 0)


def test_usage_reaches_the_decode_counters():
    m = DecodeMetrics("m")
    m.count_usage(prompt_usage(((P, 32), (H, 16)), _prefill(16, [(PPOOL, 16)])))
    m.count_usage(prompt_usage(((H, 8),), None))
    get = m.registry.get_sample_value
    assert get("baton_decode_recomputed_held_tokens_total") == 32
    assert get("baton_decode_cached_prompt_tokens_total", {"source": "decode_pool"}) == 16
    assert get("baton_decode_cached_prompt_tokens_total", {"source": "host_tier"}) == 8


def _out(tokens: list[int], done: int = 0) -> StepOutput:
    """A step's output; `done`: finished with that many output tokens in all."""
    return StepOutput("r", tokens, "x" * len(tokens), [], bool(done),
                      "length" if done else None, None, 80, done or len(tokens), 0)


def test_completion_0s_first_chunk_carries_the_prompt_usage():
    """Known once the prompt is prefilled, so the gateway can state the cache split when a
    stream starts (Anthropic's message_start); Finished.usage says the same."""
    job = Job("r", list(range(80)), SamplingParams(n=2, max_tokens=4))
    seq = SimpleNamespace(usage=prompt_usage(((P, 16),), _prefill(64, [(PPOOL, 64)])),
                          remote=None, engine_request=None, decode_cached_tokens=16)
    job.sequences = [seq, seq]
    builder = ResponseBuilder(job, DecodeMetrics("m"))
    msgs = [*builder.add(1, _out([5])), *builder.add(0, _out([6])), *builder.add(0, _out([7])),
            *builder.add(0, _out([], done=2)), *builder.add(1, _out([], done=1))]
    chunks = [m.tokens for m in msgs]
    assert [c.HasField("prompt_usage") for c in chunks] == [False, True, False]
    first = chunks[1].prompt_usage
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (80, 0, 64)
    assert [(c.source, c.num_tokens) for c in first.cached_by] == [(DPOOL, 16), (PPOOL, 48)]
    final = [m.finished.usage for m in builder.finish()]
    assert len(final) == 2 and final[0].cached_tokens == first.cached_tokens
    assert list(final[0].cached_by) == list(first.cached_by) and final[0].completion_tokens == 3
