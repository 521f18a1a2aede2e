"""Translations between the gRPC messages (protos/) and the engine's own objects.

Both workers and the gateway speak `protos/`; the engine speaks dataclasses. Every
conversion lives here, once, so the two sides of a hand-off read a message the same way:

    common_pb2.SamplingParams  ⇄  SamplingParams        (sampling_params_from/to_proto)
    common_pb2.StructuredOutput ⇄ StructuredOutput      (inside them)
    common_pb2.TokenLogprobs   ⇄  TokenLogprob          (logprob_from/to_proto)
    "stop" | "length" | ...    →  FinishReason enum     (FINISH_REASONS)
    EngineStats                →  WorkerStats           (worker_stats)
    kv_source spans            →  [CachedTokens]        (cached_spans_to_proto)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from baton.engine.kv_source import KVSource, Spans
from baton.outputs import TokenLogprob
from baton.sampling_params import SamplingParams, StructuredOutput
from protos import common_pb2

if TYPE_CHECKING:
    from baton.engine.stats import EngineStats

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_U64 = 1 << 64
# by name: KVSource.HOST_TIER ("host_tier") → KV_SOURCE_HOST_TIER; POOL is the role's own;
# PEER, what a prefill worker read from the decode worker's pool, is that pool
_SOURCES = {s: common_pb2.KVSource.Value(f"KV_SOURCE_{s.value.upper()}")
            for s in KVSource if s not in (KVSource.POOL, KVSource.PEER)}
_SOURCES[KVSource.PEER] = common_pb2.KV_SOURCE_DECODE_POOL


def wire_spans(spans: Spans, pool: int) -> tuple[tuple[int, int], ...]:
    """An engine's spans with common_pb2.KVSource values: its pool becomes `pool`
    (KV_SOURCE_DECODE_POOL or KV_SOURCE_PREFILL_POOL, the role's), tiers their own."""
    return tuple((pool if s is KVSource.POOL else _SOURCES[s], n) for s, n in spans)


def source_label(source: int) -> str:
    """A common_pb2.KVSource's short name: "decode_pool", "host_tier", ..."""
    return common_pb2.KVSource.Name(source).removeprefix("KV_SOURCE_").lower()


def cached_spans_to_proto(spans, pool: int) -> list[common_pb2.CachedTokens]:
    """CachedTokens messages of an engine's spans (`wire_spans`), in prompt order."""
    return [common_pb2.CachedTokens(source=s, num_tokens=n) for s, n in wire_spans(spans, pool)]


def sampling_params_from_proto(p: common_pb2.SamplingParams, **overrides) -> SamplingParams:
    """The engine's SamplingParams for a proto, with the proto's zero-means-default rules
    (see common.proto). `overrides` replace fields (e.g. max_tokens=1 for a prefill).
    Raises ValueError for values the engine refuses (NaN, top_p > 1, max_tokens = 0, ...)."""
    fields = dict(
        n=p.n or 1,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=max(p.top_k, 0),
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        logit_bias=_logit_bias_from_proto(p.logit_bias),
        structured_output=structured_output_from_proto(p.structured_output)
        if p.HasField("structured_output") else None,
    )
    fields.update(overrides)
    return SamplingParams(**fields)


def sampling_params_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """The proto of an engine SamplingParams (exact inverse of sampling_params_from_proto)."""
    p = common_pb2.SamplingParams(
        n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
        min_p=sp.min_p, min_tokens=sp.min_tokens, stop=sp.stop,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
        logit_bias=[common_pb2.TokenBias(token_id=t, bias=b)
                    for t, b in sp.logit_bias.items()])
    if sp.seed is not None:
        p.seed = sp.seed % _U64
    if sp.max_tokens is not None:
        p.max_tokens = sp.max_tokens
    if sp.logprobs is not None:
        p.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        p.prompt_logprobs = sp.prompt_logprobs
    if sp.structured_output is not None:
        so = sp.structured_output
        p.structured_output.CopyFrom(common_pb2.StructuredOutput(
            kind=int(so.kind), json_schema=so.json_schema, prefix=so.prefix, suffix=so.suffix))
    return p


def structured_output_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutput:
    """ValueError for an UNSPECIFIED kind or a json_schema that is not a JSON object (whether
    the grammar compiles is checked where it is compiled: baton/engine/grammar.py)."""
    if p.kind == common_pb2.STRUCTURED_OUTPUT_KIND_UNSPECIFIED:
        raise ValueError("structured_output.kind is required")
    return StructuredOutput(p.kind, p.json_schema, p.prefix, p.suffix)


def _logit_bias_from_proto(entries) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in entries:
        if e.token_id in out:
            raise ValueError(f"logit_bias lists token id {e.token_id} twice")
        out[e.token_id] = e.bias
    return out


def seed_for_index(seed: int | None, index: int) -> int | None:
    """Seed of completion `index` of an n > 1 request (same rule as baton.LLM)."""
    return None if seed is None else (seed + index) % _U64


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprobs:
    """Proto of one token's logprobs (rank 0 = unknown)."""
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top])


def logprob_from_proto(p: common_pb2.TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, {t.token_id: t.logprob for t in p.top}, p.rank)


def worker_stats(stats: EngineStats, role: int, worker_id: str, layout: common_pb2.KVLayout,
                 kv_epoch: int) -> common_pb2.WorkerStats:
    """The WorkerStats message of an engine snapshot (`LLMEngine.stats`, engine thread).

    num_waiting counts queued requests and those waiting for remote KV; num_free_blocks counts
    blocks no live request holds (cached-but-evictable ones included, so an idle worker reports
    num_free_blocks == num_total_blocks); block hashes always come as a full snapshot.
    """
    c = stats.counts
    msg = common_pb2.WorkerStats(
        role=role, worker_id=worker_id, num_running=c.num_running,
        num_waiting=c.num_waiting + c.num_waiting_for_remote_kv,
        num_waiting_tokens=stats.num_waiting_tokens, num_free_blocks=c.num_free_blocks,
        num_total_blocks=c.num_total_blocks, num_cached_blocks=stats.num_cached_blocks,
        load=stats.load, kv_layout=layout, kv_epoch=kv_epoch,
        prefill_tokens_per_s=stats.prefill_tokens_per_s)
    if stats.block_hashes:
        msg.snapshot.block_hashes.extend(stats.block_hashes)
    return msg
