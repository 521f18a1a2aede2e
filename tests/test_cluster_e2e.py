"""End to end: `baton up` (gateway + prefill + decode processes, tiny model) and the official
`openai` client: chat, streaming with usage, stop strings, seeds, tool-message history, n=2,
session prefix-cache hits, and round-robin routing losing them."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.load_helpers import free_port
from tests.restart_helpers import Output

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
SYSTEM = ("You are a travel agent. Use tools to look up flights, then answer briefly. "
          "Flight UA 123 from SFO to JFK departs at 10:45. Baggage allowance: two bags.")


@contextlib.contextmanager
def baton_up(model: Path | str, *args: str, timeout: float = 240.0,
             command: tuple[str, ...] = (sys.executable, "-m", "baton.cli"),
             cwd: Path = REPO, env: dict[str, str] | None = None, num_blocks: int | None = 256,
             follow: bool = False):
    """Run `baton up` (`command` up ...: this checkout's by default) until its ready banner;
    yield (base_url, process); stop with SIGINT. num_blocks None: pools sized by `baton up`
    from the memory free (its default). follow: a thread reads the rest of its output
    (restart_helpers.Output) and (base_url, process, output) is yielded."""
    port = free_port()
    pool = ["--num-blocks", str(num_blocks)] if num_blocks is not None else []
    proc = subprocess.Popen(
        [*command, "up", "--model", str(model), "--port", str(port), *pool, *args],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env if env is not None else {**os.environ, "PYTHONPATH": str(REPO)})
    lines, output = [], None
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            if "[baton up] ready:" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        else:
            raise AssertionError(f"baton up exited ({proc.wait()}):\n{''.join(lines)}")
        url = f"http://127.0.0.1:{port}"
        output = Output(proc) if follow else None
        yield (url, proc) if output is None else (url, proc, output)
    finally:
        since = output.mark() if output is not None else 0
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60) if output is None else ("", proc.wait(60))
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        if output is not None:
            rest = output.rest(since, 10.0)
        assert "[baton up] stopped" in rest, "".join(lines) + rest


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    # the remote path for every prompt of 16 uncached tokens or more: what these tests check
    with baton_up(tiny_llama, "--num-decode", "2", "--min-remote-tokens", "16") as (url, proc):
        yield url, proc


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=cluster[0] + "/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


def model_of(client) -> str:
    """The served name (`baton up --model FOLDER` serves it under the folder's name)."""
    return client.models.list().data[0].id


def chat(client, messages, session: str | None = None, **kw):
    headers = {"X-Session-ID": session} if session else None
    return client.chat.completions.create(model=model_of(client), messages=messages,
                                          extra_headers=headers, **kw)


def test_chat_and_models(client, tiny_llama):
    assert [m.id for m in client.models.list().data] == [tiny_llama.name]
    r = chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=8,
             temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streaming_with_usage(client):
    stream = chat(client, [{"role": "user", "content": "Tell me about flights"}],
                  max_tokens=10, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens >= 1
    full = chat(client, [{"role": "user", "content": "Tell me about flights"}],
                max_tokens=10, temperature=0)
    assert text == full.choices[0].message.content  # greedy: same text either way


def test_stop_strings(client):
    base = chat(client, [{"role": "user", "content": "Count please"}], max_tokens=12,
                temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].message.content
    assert len(text) >= 4
    stop = text[2:4]
    cut = chat(client, [{"role": "user", "content": "Count please"}], max_tokens=12,
               temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[:text.index(stop)]


def test_seed_reproducibility(client):
    msgs = [{"role": "user", "content": "Pick a destination"}]
    runs = [chat(client, msgs, max_tokens=12, temperature=1.0, seed=1234,
                 extra_body={"ignore_eos": True}).choices[0].message.content for _ in range(2)]
    assert runs[0] == runs[1]


def test_n2(client):
    r = chat(client, [{"role": "user", "content": "Two options"}], n=2, max_tokens=6,
             temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 12


def test_multi_turn_tool_history_and_prefix_cache(client):
    tools = [{"type": "function", "function": {
        "name": "find_flight", "description": "Look up a flight",
        "parameters": {"type": "object", "properties": {"number": {"type": "string"}}}}}]
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "When does UA 123 leave?"}]
    first = chat(client, history, session="agent-7", tools=tools, max_tokens=8,
                 temperature=0)
    history += [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "find_flight", "arguments": '{"number": "UA 123"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "UA 123 departs 10:45 from SFO"},
    ]
    second = chat(client, history, session="agent-7", tools=tools, max_tokens=8,
                  temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    history += [{"role": "assistant", "content": second.choices[0].message.content},
                {"role": "user", "content": "And the baggage allowance?"}]
    third = chat(client, history, session="agent-7", max_tokens=8, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens >= \
        second.usage.prompt_tokens_details.cached_tokens


def test_bad_requests_answered_and_cluster_alive(client):
    with pytest.raises(openai.BadRequestError):
        chat(client, [], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-x", messages=[{"role": "user",
                                                                 "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_of(client), prompt="", max_tokens=4)
    assert chat(client, [{"role": "user", "content": "still there?"}],
                max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_round_robin_loses_the_session_cache(tiny_llama):
    """Two decode workers, round-robin: the second turn lands on the other worker, so its
    prompt is not in that worker's prefix cache (session routing keeps it: test above)."""
    with baton_up(tiny_llama, "--num-decode", "2", "--routing", "round-robin",
                  "--min-remote-tokens", "100000") as (url, _):
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           timeout=120) as c:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            chat(c, msgs, session="s", max_tokens=4, temperature=0)
            msgs += [{"role": "assistant", "content": "Hello"},
                     {"role": "user", "content": "When does UA 123 leave?"}]
            second = chat(c, msgs, session="s", max_tokens=4, temperature=0)
            assert second.usage.prompt_tokens_details.cached_tokens == 0
