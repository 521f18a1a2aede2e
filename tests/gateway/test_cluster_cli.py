"""`baton up` failure paths, fast: stand-in role processes instead of real workers."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from baton.cluster import up as cluster
from baton.cluster.child import Child
from baton.cluster.plan import cpu_plan


def test_bad_arguments_and_unknown_model(capsys, tmp_path):
    assert cluster.main(["--num-decode", "0"]) == 2
    assert cluster.main(["--model", str(tmp_path / "missing"), "--port", "0"]) == 1
    assert "unknown model" in capsys.readouterr().err


def test_child_dying_during_startup_fails_clearly(monkeypatch, capsys, tiny_llama, tmp_path):
    _fake_roles(monkeypatch)  # the gateway too: it starts beside the workers
    monkeypatch.setenv("FAKE_ROLE_EXIT", "3")
    start = time.monotonic()
    code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                         "--startup-timeout", "30", "--port", "0"])
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


def _pid_lines(log: Path, count: int) -> list[tuple[int, int]]:
    """The first `count` `pid=P port=N` lines of a fake role's log (waits, bounded)."""
    for _ in range(300):
        found = re.findall(r"pid=(\d+) port=(\d+)", log.read_text() if log.exists() else "")
        if len(found) >= count:
            return [(int(p), int(n)) for p, n in found[:count]]
        time.sleep(0.05)
    raise AssertionError(f"{log}: fewer than {count} pid lines")


def _serving_cluster(monkeypatch, model: Path, log_dir: Path, *flags: str):
    """Fake roles (with a healthy gateway); run `baton up` in this thread. Returns
    (run, serving, said): run() → exit status; `serving` is set once the banner is out;
    `said` collects the supervisor's lines."""
    _fake_roles(monkeypatch)
    monkeypatch.setenv("FAKE_ROLE_HEALTH", "1")
    monkeypatch.delenv("FAKE_ROLE_EXIT", raising=False)
    serving, said = threading.Event(), []
    banner = cluster._banner
    monkeypatch.setattr(cluster, "_banner", lambda a, c: (serving.set(), banner(a, c))[1])
    say = cluster._say
    monkeypatch.setattr(cluster, "_say", lambda line: (said.append(line), say(line)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--model", str(model), "--log-dir", str(log_dir), "--port", str(port),
            "--startup-timeout", "30", "--stop-timeout", "5", "--shutdown-grace-s", "0", *flags]
    return (lambda: cluster.main(argv)), serving, said


def _in_thread(fn, stop_after: bool) -> threading.Thread:
    """Run fn beside `baton up`; SIGTERM this process (stopping it) when fn fails, or after
    fn when stop_after."""
    def run():
        try:
            fn()
        except BaseException:
            os.kill(os.getpid(), signal.SIGTERM)
            raise
        if stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dead_worker_is_restarted_on_its_port(monkeypatch, tmp_path, tiny_llama):
    run, serving, said = _serving_cluster(monkeypatch, tiny_llama, tmp_path,
                                          "--restart-delay-s", "0.1")
    log = tmp_path / "prefill-0.log"
    pids: list[tuple[int, int]] = []

    def kill_then_stop():
        assert serving.wait(30)
        first = _pid_lines(log, 1)[0]
        os.kill(first[0], signal.SIGKILL)
        pids.extend(_pid_lines(log, 2))
        for _ in range(300):  # until the supervisor saw it back (READY)
            if any("is back" in line for line in said):
                break
            time.sleep(0.05)

    chaos = _in_thread(kill_then_stop, stop_after=True)
    code = run()
    chaos.join(10)
    assert code == 0
    (pid1, port1), (pid2, port2) = pids
    assert pid1 != pid2 and port1 == port2  # a new process on the same port
    assert said[0].startswith(f"[baton up] prefill-0 exited with status -9 (SIGKILL); "
                              f"restart 1 in 0.1 s on port {port1}. The end of {log}:")
    assert said[1] == f"[baton up] prefill-0 is back on port {port1} (restart 1)"
    assert len(said) == 2  # nothing else died, nothing stopped the cluster


def test_exit_on_child_failure_stops_the_cluster(monkeypatch, tmp_path, tiny_llama):
    run, serving, said = _serving_cluster(monkeypatch, tiny_llama, tmp_path,
                                          "--exit-on-child-failure")
    log = tmp_path / "decode-0.log"

    def kill():
        assert serving.wait(30)
        os.kill(_pid_lines(log, 1)[0][0], signal.SIGKILL)

    chaos = _in_thread(kill, stop_after=False)
    code = run()
    chaos.join(10)
    assert code == 1
    assert said[0].startswith("[baton up] decode-0 exited with status -9 (SIGKILL); stopping.")
    assert len(_pid_lines(log, 1)) == 1 and "pid=" not in log.read_text().split("\n", 1)[1]


def test_api_key_stays_out_of_output_and_ps(monkeypatch, tmp_path, tiny_llama, capsys):
    """Issue 27: `baton up --api-key K` prints the curl hint with $BATON_API_KEY, not K, and
    hands K to the gateway in its environment, not on its command line (`ps` shows that)."""
    key = "sekret-key-4a7f"
    run, serving, _ = _serving_cluster(monkeypatch, tiny_llama, tmp_path, "--api-key", key)
    seen: dict[str, bytes] = {}

    def inspect_gateway():
        assert serving.wait(30)
        pid = _pid_lines(tmp_path / "gateway.log", 1)[0][0]
        seen["cmdline"] = Path(f"/proc/{pid}/cmdline").read_bytes()
        seen["environ"] = Path(f"/proc/{pid}/environ").read_bytes()

    probe = _in_thread(inspect_gateway, stop_after=True)
    code = run()
    probe.join(10)
    assert code == 0
    assert key.encode() not in seen["cmdline"] and b"--api-key" not in seen["cmdline"]
    assert f"BATON_API_KEY={key}".encode() in seen["environ"].split(b"\0")
    out = capsys.readouterr()
    assert key not in out.out + out.err
    assert '-H "Authorization: Bearer $BATON_API_KEY"' in out.out


def test_a_restarted_gateway_gets_the_workers_file_again(monkeypatch, tmp_path, tiny_llama):
    """The gateway learns the workers from LOG_DIR/workers-PID.json; one restarted after
    the file was removed (a tmp cleaner) gets it written again, not an empty cluster."""
    run, serving, said = _serving_cluster(monkeypatch, tiny_llama, tmp_path,
                                          "--restart-delay-s", "0.1")
    seen: list[dict] = []

    def remove_then_kill():
        assert serving.wait(30)
        (path,) = tmp_path.glob("workers-*.json")
        path.unlink()
        os.kill(_pid_lines(tmp_path / "gateway.log", 1)[0][0], signal.SIGKILL)
        for _ in range(300):
            if any("is back" in line for line in said):
                break
            time.sleep(0.05)
        seen.append(json.loads(path.read_text()))

    chaos = _in_thread(remove_then_kill, stop_after=True)
    code = run()
    chaos.join(10)
    assert code == 0 and any("gateway is back" in line for line in said), said
    assert len(seen[0]["decode"]) == 1 and len(seen[0]["prefill"]) == 1, seen
