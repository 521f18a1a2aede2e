"""Multi-host: prefill, decode and gateway each on its own "host" (a network namespace, see
tests/deploy/netns.py), a client on a fourth; real requests through the gateway.

For each transport (NIXL = UCX over TCP on the veth, and gRPC) it checks that
  - outputs equal the colocated engine (`baton.LLM` in-process, greedy, the dtype
    `auto` chooses here, as the workers do), for a long
    prompt, its second turn (prefix cached on decode) and a short prompt;
  - the long prompts were prefilled remotely (decode: 2 remote prefills ok, 1 kept local)
    and their KV came across: bytes received by decode == bytes sent by prefill > 0;
  - those bytes crossed hosts: decode's veth received at least that many bytes and
    prefill's veth sent at least that many. (With UCX's defaults, processes of one machine
    move NIXL WRITEs by shared memory / CMA even from different namespaces, and the KV
    never touches the veth: UCX_TLS=tcp makes UCX use the network like two machines.)
Decode runs with --on-prefill-failure fail, so a broken transfer fails the request instead
of being recomputed locally (which would still give the right tokens).
Root only; skipped with the reason where namespaces cannot be made.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from baton.sampling_params import SamplingParams
from tests.deploy import netns

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BLOCK, NUM_BLOCKS, MIN_REMOTE, MAX_TOKENS = 8, 256, 16, 8
PORTS = {"prefill": 50052, "decode": 50051, "gateway": 8000}
METRICS_PORT = 9100
START_TIMEOUT_S, REQUEST_TIMEOUT_S = 240.0, 120.0


class Role:
    """A role process in the lab: its log file, and an event set on its ready line."""

    def __init__(self, name: str, proc: subprocess.Popen, log_path: Path, ready: str) -> None:
        self.name, self.proc, self.log_path = name, proc, log_path
        self.ready = threading.Event()
        threading.Thread(target=self._read, args=(re.compile(ready),), daemon=True).start()

    def _read(self, ready: re.Pattern) -> None:
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if ready.search(line):
                    self.ready.set()

    def wait(self, deadline: float) -> None:
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = "exited" if self.proc.poll() is not None else "timed out"
                raise AssertionError(f"{self.name} {state} before ready:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])


def role_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(PYTHONPATH=str(REPO), UCX_TLS="tcp", UCX_NET_DEVICES=netns.IFACE,
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return env


def role_argv(role: str, lab: netns.Lab, model: Path, transport: str) -> list[str]:
    host, port = lab.address(role), PORTS[role]
    if role == "gateway":
        return [sys.executable, "-m", "gateway", "--model", str(model), "--host", host,
                "--port", str(port), "--poll-interval-s", "0.2",
                "--decode", f"{lab.address('decode')}:{PORTS['decode']}",
                "--prefill", f"{lab.address('prefill')}:{PORTS['prefill']}"]
    argv = [sys.executable, "-m", f"{role}_service", "--model", str(model), "--host", host,
            "--port", str(port), "--advertise-address", f"{host}:{port}",
            "--metrics-port", str(METRICS_PORT), "--transport", transport,
            "--block-size", str(BLOCK), "--num-blocks", str(NUM_BLOCKS), "--drain-seconds", "2"]
    if role == "decode":
        argv += ["--prefill-address", f"{lab.address('prefill')}:{PORTS['prefill']}",
                 "--min-remote-tokens", str(MIN_REMOTE), "--on-prefill-failure", "fail"]
    return argv


@contextmanager
def cluster(lab: netns.Lab, model: Path, transport: str, log_dir: Path):
    """Start all three at once (the gateway finds the workers as they come up); wait until
    the gateway reports every worker healthy; yield; stop all."""
    deadline = time.monotonic() + START_TIMEOUT_S
    roles = {}
    try:
        for role in ("prefill", "decode", "gateway"):
            log_path = log_dir / f"{transport}-{role}.log"
            with open(log_path, "w") as log:
                proc = lab.spawn(role, role_argv(role, lab, model, transport), role_env(), log)
            roles[role] = Role(role, proc, log_path,
                               r"\[gateway\] serving" if role == "gateway" else r"^READY port=")
        for role in roles.values():
            role.wait(deadline)
        health = client(lab, {"wait_health": f"{url(lab, 'gateway')}/health",
                              "deadline_s": 60})["wait_health"]
        assert health["ok"], health
        yield roles
    except BaseException:
        print("\n".join(f"--- {r.name}\n{r.tail()}" for r in roles.values()), file=sys.stderr)
        raise
    finally:
        lab.stop_processes()


def url(lab: netns.Lab, role: str, port: int | None = None) -> str:
    return f"http://{lab.address(role)}:{port or PORTS[role]}"


def client(lab: netns.Lab, job: dict) -> dict:
    """Run one job on the client host (the hub namespace)."""
    job = {"timeout_s": REQUEST_TIMEOUT_S, **job}
    out = lab.run("hub", [sys.executable, str(REPO / "tests/deploy/netns_client.py")],
                  timeout=REQUEST_TIMEOUT_S * 4, env=role_env(), stdin=json.dumps(job))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


@pytest.fixture(scope="module")
def lab():
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(f"multi-host lab unavailable: {reason}")
    netns.sweep_stale()
    lab = netns.Lab()
    try:
        yield lab.up()
    finally:
        lab.close()
    assert not [n for n in netns_names() if n.startswith(lab.name)], "namespaces left over"


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    from baton import LLM

    return LLM(str(tiny_llama), block_size=BLOCK, num_blocks=NUM_BLOCKS)  # dtype auto, as the workers


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_kv_crosses_hosts(lab, tiny_llama, colocated, transport, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    turn1 = prompt_of(300, seed=1)
    out1 = colocated.generate([turn1], greedy)[0]
    turn2 = turn1 + out1.output_token_ids + prompt_of(40, seed=2)
    short = prompt_of(MIN_REMOTE - 6, seed=3)
    prompts = [turn1, turn2, short]
    expected = [o.text for o in colocated.generate(prompts, greedy)]

    with cluster(lab, tiny_llama, transport, tmp_path):
        before = {h: lab.iface_bytes(h) for h in ("prefill", "decode")}
        bodies = [{"model": str(tiny_llama), "prompt": p, "max_tokens": MAX_TOKENS,
                   "temperature": 0, "ignore_eos": True} for p in prompts]
        replies = client(lab, {"post": [[f"{url(lab, 'gateway')}/v1/completions", b]
                                        for b in bodies]})["post"]
        after = {h: lab.iface_bytes(h) for h in ("prefill", "decode")}
        decode_m, prefill_m = (text for _, text in client(lab, {"get": [
            url(lab, "decode", METRICS_PORT) + "/metrics",
            url(lab, "prefill", METRICS_PORT) + "/metrics"]})["get"])

    assert [r["status"] for r in replies] == [200, 200, 200], replies
    texts = [r["body"]["choices"][0]["text"] for r in replies]
    assert texts == expected
    assert [r["body"]["usage"]["completion_tokens"] for r in replies] == [MAX_TOKENS] * 3
    assert replies[1]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    outcomes = dict(re.findall(r'^baton_decode_remote_prefills_total\{outcome="(\w+)"\} (\S+)$',
                               decode_m, re.M))
    assert {k: float(v) for k, v in outcomes.items()} == {"ok": 2.0, "local": 1.0}
    received = metric(decode_m, "baton_kv_received_bytes_total")
    sent = metric(prefill_m, "baton_kv_transferred_bytes_total")
    # large enough to dwarf control traffic on the veth (~90 KB in bf16, twice that in fp32)
    assert received == sent >= 50_000
    decode_rx = after["decode"][0] - before["decode"][0]
    prefill_tx = after["prefill"][1] - before["prefill"][1]
    assert decode_rx >= received and prefill_tx >= sent, (decode_rx, prefill_tx, received)


def test_lab_cleans_up_after_a_failure():
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(f"multi-host lab unavailable: {reason}")
    lab = netns.Lab(name=f"{netns.PREFIX}{os.getpid()}-cleanup")
    proc = None
    with pytest.raises(RuntimeError, match="boom"):
        try:
            lab.up()
            with open(os.devnull, "w") as devnull:
                proc = lab.spawn("decode", ["sleep", "300"], dict(os.environ), devnull)
            raise RuntimeError("boom")
        finally:
            lab.close()
    assert proc is not None and proc.poll() is not None
    assert not [n for n in netns_names() if n.startswith(lab.name)]
