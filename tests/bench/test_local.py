"""Starting and stopping servers for a run (process groups, readiness, failures)."""
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from baton.bench.local import ServerSpec, ServerStartError, running_server, stop_group


def test_spec_argv():
    spec = ServerSpec("kv", mode="disaggregated", routing="kv", num_decode=2)
    argv = spec.argv("smollm2-135m", 8123)
    assert argv[1:4] == ["-m", "baton.cli", "up"]
    assert argv[argv.index("--routing") + 1] == "kv"
    assert argv[argv.index("--num-decode") + 1] == "2"
    assert argv[argv.index("--port") + 1] == "8123"
    assert "--num-prefill" not in ServerSpec("c", mode="colocated").argv("m", 1)
    hf = ServerSpec("hf", kind="hf").argv("m", 9)
    assert hf[1:3] == ["-m", "baton.bench.hf_baseline"]


def test_stop_group_kills_leader_and_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    stop_group(proc, grace_s=2.0)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while _alive(child):  # a killed orphan may linger as a zombie until init reaps it
        assert time.monotonic() < deadline, "the worker's child survived"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass(frozen=True)
class _Exits(ServerSpec):
    def argv(self, model, port, log_dir=None):
        return [sys.executable, "-c", "raise SystemExit(3)"]


_D = "disaggregated"


def test_server_that_exits_is_an_error(tmp_path):
    with pytest.raises(ServerStartError, match="exited with 3"):
        with running_server(_Exits("broken"), "m", tmp_path / "log", timeout_s=20):
            pass


def test_compare_routing_configs_are_colocated_pinned_and_bounded():
    from baton.bench.compare import spec_for
    for name in ("session", "kv", "round-robin"):
        argv = spec_for(name, 512).argv("m", 1)
        assert argv[argv.index("--mode") + 1] == "colocated"
        assert argv[argv.index("--num-decode") + 1] == "2"
        assert argv[argv.index("--num-blocks") + 1] == "512"  # the same pool for every policy
        assert argv[argv.index("--pin") + 1] == "split"
    four = spec_for("round-robin", 512, routing_workers=4).argv("m", 1)
    assert four[four.index("--num-decode") + 1] == "4"
    for name in ("disaggregated", "colocated"):  # the README's `baton up`, nothing added
        argv = spec_for(name).argv("m", 1)
        assert argv[argv.index("up") + 1:] == ["--model", "m", "--port", "1", "--mode", name,
                                               "--routing", "session", "--num-decode", "1",
                                               *(["--num-prefill", "1"] if name == _D else [])]
    assert spec_for("admission").argv("m", 1)[:-2] == spec_for(_D).argv("m", 1)


def test_compare_tier_pair_differs_only_in_the_host_tier():
    """tiers vs no-tiers: the same worker and small pool; only "tiers" has a host tier, and
    `baton up` parses both command lines (the flags reach the worker)."""
    from baton.bench.compare import spec_for
    from baton.cluster.flags import parse_up_args
    with_tier = spec_for("tiers", tier_num_blocks=200, tier_host_bytes=1 << 20).argv("m", 1)
    without = spec_for("no-tiers", tier_num_blocks=200).argv("m", 1)
    for argv in (with_tier, without):
        assert argv[argv.index("--num-blocks") + 1] == "200"
        assert argv[argv.index("--mode") + 1] == "colocated"
    assert with_tier[with_tier.index("--kv-host-tier-bytes") + 1] == str(1 << 20)
    assert "--kv-host-tier-bytes" not in without  # and no tier sized from free memory:
    assert without[without.index("--kv-host-tier-fraction") + 1] == "0"
    up = parse_up_args(with_tier[with_tier.index("up") + 1:])
    assert (up.kv_host_tier_bytes, up.num_blocks) == (1 << 20, 200)


def test_compare_admission_is_disaggregated_with_the_bench_slo():
    """"admission" = "disaggregated" plus the gateway's TTFT SLO, set from the bench's own
    --slo-ttft (seconds → ms), so goodput judges requests by the SLO admission predicts."""
    from baton.bench.compare import spec_for
    from baton.cluster.flags import parse_up_args
    adm = spec_for("admission", slo_ttft_s=1.5).argv("m", 1)
    base = spec_for("disaggregated").argv("m", 1)
    assert adm[adm.index("--slo-ttft-ms") + 1] == "1500"
    assert [a for a in adm if a not in ("--slo-ttft-ms", "1500")] == base
    up = parse_up_args(adm[adm.index("up") + 1:])
    assert up.slo_ttft_ms == 1500.0
