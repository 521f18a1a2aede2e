"""vLLM-named series on both workers' registries, from a fake engine (no model)."""
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton.engine.stats import EngineCounts
from decode_service.metrics import DecodeMetrics
from prefill_service.metrics import PrefillMetrics

COUNTS = EngineCounts(num_running=3, num_waiting=2, num_waiting_for_remote_kv=1,
                      num_free_blocks=25, num_total_blocks=100, num_preemptions=4,
                      prefix_cache_queries=1000, prefix_cache_hits=750, prompt_tokens=900,
                      generation_tokens=120)
LABELS = {"model_name": "smollm2-135m", "engine": "0"}


class FakeEngine:
    def counts(self) -> EngineCounts:
        return COUNTS


def _samples(registry) -> dict[str, tuple[dict, float]]:
    text = generate_latest(registry).decode()
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("vllm:") and "le" not in s.labels}


def test_engine_series_have_vllm_names_labels_and_values():
    m = PrefillMetrics("smollm2-135m")
    m.watch(FakeEngine(), {})
    got = _samples(m.registry)
    want = {"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 3,
            "vllm:kv_cache_usage_perc": 0.75, "vllm:prefix_cache_queries_total": 1000,
            "vllm:prefix_cache_hits_total": 750, "vllm:num_preemptions_total": 4,
            "vllm:prompt_tokens_total": 900, "vllm:generation_tokens_total": 120}
    assert {k: v for k, (_, v) in got.items() if k in want} == want
    assert all(got[k][0] == LABELS for k in want)
    assert "vllm:time_to_first_token_seconds_count" not in got  # prefill sees no stream


def test_decode_observes_vllm_ttft_and_itl_beside_its_own():
    m = DecodeMetrics("smollm2-135m")
    m.watch(FakeEngine())
    m.observe_first_token(0.2)
    m.observe_tokens(0.05, 2)
    got = _samples(m.registry)
    assert got["vllm:time_to_first_token_seconds_count"] == (LABELS, 1.0)
    assert got["vllm:time_to_first_token_seconds_sum"] == (LABELS, 0.2)
    assert got["vllm:inter_token_latency_seconds_count"] == (LABELS, 2.0)
    assert got["vllm:num_requests_running"] == (LABELS, 3.0)
    assert m.ttft.collect()[0].samples  # Baton's own histograms still there
    text = generate_latest(m.registry).decode()
    assert "baton_ttft_seconds_count 1.0" in text and "baton_itl_seconds_count 1.0" in text


def test_spec_decode_counters_have_vllm_names_and_positions():
    class SpecEngine:
        def counts(self) -> EngineCounts:
            return COUNTS._replace(spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=17,
                                   spec_accepted_per_pos=(9, 5, 3, 0))
    m = DecodeMetrics("smollm2-135m")
    m.watch(SpecEngine())
    text = generate_latest(m.registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("vllm:spec_decode")]
    flat = {s.name: s.value for s in samples if "position" not in s.labels}
    assert flat == {"vllm:spec_decode_num_drafts_total": 10,
                    "vllm:spec_decode_num_draft_tokens_total": 40,
                    "vllm:spec_decode_num_accepted_tokens_total": 17}
    per_pos = {s.labels["position"]: s.value for s in samples if "position" in s.labels}
    assert per_pos == {"0": 9, "1": 5, "2": 3, "3": 0}
    assert all(s.labels["model_name"] == "smollm2-135m" for s in samples)
