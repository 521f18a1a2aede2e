"""`baton up` failure paths, fast: stand-in role processes instead of real workers."""
from __future__ import annotations

import os
import socket
import sys
import time

from baton.cluster import up as cluster
from baton.cluster.child import Child
from baton.cluster.plan import cpu_plan


def test_bad_arguments_and_unknown_model(capsys, tmp_path):
    assert cluster.main(["--num-decode", "0"]) == 2
    assert cluster.main(["--model", str(tmp_path / "missing")]) == 1
    assert "unknown model" in capsys.readouterr().err


def test_child_dying_during_startup_fails_clearly(monkeypatch, capsys, tiny_llama, tmp_path):
    monkeypatch.setitem(cluster.ROLE_MODULES, "prefill", "tests.gateway.fake_role")
    monkeypatch.setitem(cluster.ROLE_MODULES, "decode", "tests.gateway.fake_role")
    monkeypatch.setenv("FAKE_ROLE_EXIT", "3")
    start = time.monotonic()
    code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                         "--startup-timeout", "30"])
    assert code == 1 and time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "exited with status 3 during start-up" in err
    assert "fake role failing on purpose" in err  # the tail of its log


def test_gateway_that_never_gets_healthy_times_out(monkeypatch, capsys, tiny_llama, tmp_path):
    for role in ("prefill", "decode", "gateway"):
        monkeypatch.setitem(cluster.ROLE_MODULES, role, "tests.gateway.fake_role")
    monkeypatch.delenv("FAKE_ROLE_EXIT", raising=False)
    code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                         "--startup-timeout", "2", "--port", "9"])
    assert code == 1
    assert "did not report every worker healthy within 2 s" in capsys.readouterr().err


def test_cpu_plan_pins_roles_to_disjoint_cpus():
    plan = cpu_plan("split", "disaggregated", 1, 1, cpus=[0, 1])
    assert plan == {"prefill-0": frozenset({1}), "decode-0": frozenset({0})}
    plan = cpu_plan("split", "disaggregated", 1, 2, cpus=[0, 1, 2, 3])
    assert plan["prefill-0"] == frozenset({2, 3})
    assert plan["decode-0"] == plan["decode-1"] == frozenset({0, 1})
    assert cpu_plan("split", "colocated", 1, 2, cpus=[0, 1]) == \
        {"decode-0": frozenset({0}), "decode-1": frozenset({1})}
    assert cpu_plan("split", "colocated", 1, 1, cpus=[0, 1]) == \
        {"decode-0": frozenset({0, 1})}
    assert cpu_plan("none", "disaggregated", 1, 1, cpus=[0, 1]) == \
        {"prefill-0": None, "decode-0": None}
    assert cpu_plan("split", "disaggregated", 1, 1, cpus=[0]) == \
        {"prefill-0": None, "decode-0": None}  # one CPU: nothing to split


def test_pinned_child_runs_on_its_cpus(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    want = frozenset(cpus[:1])
    child = Child("probe", [sys.executable, "-c",
                                    "import os; print(sorted(os.sched_getaffinity(0)))"],
                          tmp_path / "probe.log", want)
    child.start(dict(os.environ))
    assert child.proc.wait(30) == 0
    for _ in range(50):
        if str(sorted(want)) in child.log_path.read_text():
            break
        time.sleep(0.1)
    assert str(sorted(want)) in child.log_path.read_text()


def _fake_roles(monkeypatch) -> None:
    for role in ("prefill", "decode", "gateway"):
        monkeypatch.setitem(cluster.ROLE_MODULES, role, "tests.gateway.fake_role")


def test_port_in_use_fails_before_anything_starts(monkeypatch, capsys, tiny_llama, tmp_path):
    _fake_roles(monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                             "--port", str(port), "--startup-timeout", "2"])
        err = capsys.readouterr().err
        assert code == 1
        assert err.strip() == (f"baton up: port {port} on 127.0.0.1 is in use (the gateway's "
                               f"HTTP port); choose another with --port")
        code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                             "--port", "0", "--grpc-port", str(port),
                             "--startup-timeout", "2"])
        assert code == 1 and "choose another with --grpc-port" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no child was started
