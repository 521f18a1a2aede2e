"""The transformers baseline server on a tiny random model: streams, counts, one at a time."""
import asyncio

from baton.bench.hf_baseline import Baseline, build_app
from baton.bench.prepare import Preparer
from baton.bench.runner import RunConfig, run_workload
from baton.bench.tokens import TokenCounter
from baton.bench.workload import Session, Turn
from tests.bench.fake_server import ServerThread


def chat(name, text):
    msgs = ({"role": "system", "content": "You are terse."}, {"role": "user", "content": text})
    return Session(name, (Turn(max_tokens=6, messages=msgs),))


def test_baseline_serves_one_request_at_a_time(tiny_llama):
    baseline = Baseline(str(tiny_llama), threads=1)
    with ServerThread(build_app(baseline, "tiny")) as url:
        cfg = RunConfig(url=url, model="tiny", concurrency=2, duration_s=20.0, progress=False)
        prep = Preparer(TokenCounter(baseline.tokenizer), "salt")
        result = asyncio.run(run_workload(cfg, [chat("a", "Hello there"),
                                                chat("b", "Flight UA 123")], prep))
    a, b = sorted(result.records, key=lambda r: r.first_token)
    assert a.ok and b.ok
    assert a.output_tokens == b.output_tokens == 6  # ignore_eos: always max_tokens
    assert a.cached_tokens == 0 and a.prompt_tokens == a.expected_prompt_tokens
    assert b.first_token >= a.chunk_times[-1]  # the second waited for the first
