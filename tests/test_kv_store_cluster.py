"""`baton up --kv-store mooncake` end to end: a local Mooncake master, two prefill workers
taken in turn (round-robin routing), so turn 2 of a session is prefilled on the worker that
did not see turn 1; its cached tokens come from the store (without it that worker has
none: test_cluster_e2e's round-robin test). Then the master is SIGKILLed: `baton up` starts
it again on its port, every worker reconnects (baton_kv_tier_reconnects_total) and a new
session's turn 2 loads turn 1 from the store again (issue 27)."""
from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import openai
import pytest

from baton.dtypes import ELEMENT_BYTES, resolve_dtype
from tests.kv_store_helpers import need_mooncake
from tests.test_cluster_e2e import SYSTEM, baton_up, chat, model_of
from tests.test_cluster_restart import _child_pid, _read_until

pytestmark = pytest.mark.slow
BS = 16
# one store value of a tiny Llama block: header 28 B + 16 int32 tokens + 2 layers × K/V ×
# 16 tokens × 2 KV heads × head size 16 × the element bytes of the dtype `baton up` chooses
# here (kv_store.py; auto: bf16 on CPUs with AVX512_BF16, else fp32)
VALUE_BYTES = 28 + BS * 4 + 2 * 2 * BS * 2 * 16 * ELEMENT_BYTES[resolve_dtype("auto")]


def _store_sums(url: str) -> dict[str, float]:
    """Σ over workers of each baton_kv_tier_*_total{tier="store"} series, by name."""
    with urllib.request.urlopen(url + "/metrics/workers", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^(baton_kv_tier_\w+_total)\{[^}]*tier="store"[^}]*\} (\S+)$', text,
                         re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_turn_two_on_the_other_prefill_worker_loads_turn_one_from_the_store(tiny_llama):
    need_mooncake()
    with baton_up(tiny_llama, "--kv-store", "mooncake", "--num-prefill", "2",
                  "--min-remote-tokens", "16",  # prefills on the prefill workers
                  "--routing", "round-robin", "--kv-store-segment-bytes", str(16 << 20),
                  "--restart-delay-s", "0.5") \
            as (url, proc), \
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                          timeout=120) as client:
        model_of(client)
        _two_turns_via_the_store(url, client, "Which flight leaves SFO for JFK?")
        os.kill(_child_pid(proc.pid, "mooncake_master"), signal.SIGKILL)
        lines: list[str] = []
        _read_until(proc, "kv-store is back on port", lines, 60)
        deadline = time.monotonic() + 60  # each worker's breaker checks about once a second
        while _store_counts(url, "baton_kv_tier_reconnects_total") < [1] * 3:
            assert time.monotonic() < deadline, _store_sums(url)
            time.sleep(0.2)
        before = _store_sums(url)["baton_kv_tier_loaded_bytes_total"]
        _two_turns_via_the_store(url, client, "Which flight leaves LAX for BOS?")
        assert _store_sums(url)["baton_kv_tier_loaded_bytes_total"] > before


def _store_counts(url: str, name: str) -> list[float]:
    """Each worker's value of the series `name`{tier="store"}, smallest first."""
    with urllib.request.urlopen(url + "/metrics/workers", timeout=10) as r:
        text = r.read().decode()
    return sorted(float(m.group(1)) for m in re.finditer(
        rf'^{name}\{{[^}}]*tier="store"[^}}]*\}} (\S+)$', text, re.M))


def _two_turns_via_the_store(url: str, client, question: str) -> None:
    """Turn 1 on one prefill worker, turn 2 on the other: it loads turn 1 from the store."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    saved = _store_sums(url).get("baton_kv_tier_saved_bytes_total", 0)
    first = chat(client, history, max_tokens=8, temperature=0)
    p1 = first.usage.prompt_tokens
    # the blocks reach the store on the workers' writer threads: wait for the bytes of turn
    # 1's full prompt blocks (bounded; a restarted master holds none: all are written again)
    deadline = time.monotonic() + 60
    while _store_sums(url).get("baton_kv_tier_saved_bytes_total", 0) < \
            saved + (p1 // BS) * VALUE_BYTES:
        assert time.monotonic() < deadline, _store_sums(url)
        time.sleep(0.2)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the baggage allowance? " * 6}]
    second = chat(client, history, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens > p1
    assert second.usage.prompt_tokens_details.cached_tokens >= (p1 // BS) * BS > 0
    details = second.usage.prompt_tokens_details.model_extra
    # the prefill worker computed nothing the decode worker held (without the store: all
    # of turn 1's blocks, recomputed although held)
    assert details["baton_recomputed_held_tokens"] == 0
    sums = _store_sums(url)
    assert sums["baton_kv_tier_loaded_bytes_total"] > 0
    assert sums.get("baton_kv_tier_dropped_blocks_total", 0) == 0
