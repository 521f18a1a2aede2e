"""`baton up`'s restart policy (baton/cluster/supervise.py) on stand-in children and a fake
clock: exact delays (exponential, capped, reset after a stable run), exact log lines, the
same port on every restart, and a restart that dies again counting as one more failure."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from baton.cluster.supervise import Backoff, Supervisor, describe_exit


@dataclass
class StubChild:
    name: str
    port: int | None
    status: int | None = None
    log_path: Path = Path("/logs/x.log")
    ready: threading.Event = field(default_factory=threading.Event)

    def exited(self) -> int | None:
        return self.status

    def log_tail(self, lines: int = 25) -> str:
        return "last words"


class StubCluster:
    def __init__(self, *children: StubChild) -> None:
        self.children = list(children)
        self.restarted: list[tuple[str, int | None]] = []

    def restart(self, child: StubChild) -> StubChild:
        new = StubChild(child.name, child.port, log_path=child.log_path)
        self.children[self.children.index(child)] = new
        self.restarted.append((child.name, child.port))
        return new


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(backoff=Backoff(initial_s=1, max_s=8, stable_s=60)):
    clock, lines = Clock(), []
    cluster = StubCluster(StubChild("prefill-0", 50123), StubChild("decode-0", 50124))
    return Supervisor(cluster, backoff, clock, lines.append), cluster, clock, lines


def test_backoff_doubles_caps_and_validates():
    b = Backoff(initial_s=1, max_s=8, stable_s=60)
    assert [b.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]
    with pytest.raises(ValueError):
        Backoff(initial_s=2, max_s=1)


def test_describe_exit():
    assert describe_exit(-9) == "status -9 (SIGKILL)"
    assert describe_exit(3) == "status 3"


def test_dead_child_restarts_on_its_port_after_the_delay():
    sup, cluster, clock, lines = make()
    cluster.children[0].status = -9
    sup.tick()
    assert lines == ["[baton up] prefill-0 exited with status -9 (SIGKILL); restart 1 in 1 s "
                     "on port 50123. The end of /logs/x.log:\nlast words"]
    clock.now += 0.5
    sup.tick()
    assert cluster.restarted == []  # not yet due; the others are untouched
    clock.now += 0.5
    sup.tick()
    assert cluster.restarted == [("prefill-0", 50123)]
    cluster.children[0].ready.set()
    sup.tick()
    assert lines[-1] == "[baton up] prefill-0 is back on port 50123 (restart 1)"
    assert cluster.children[1].status is None and len(lines) == 2


def test_crash_loop_backs_off_and_a_stable_run_resets_it():
    sup, cluster, clock, lines = make()
    delays = []
    for _ in range(5):  # dies again right after each restart (e.g. its port still held)
        cluster.children[0].status = 1
        sup.tick()
        delays.append(sup.records["prefill-0"].due - clock.now)
        clock.now = sup.records["prefill-0"].due
        sup.tick()
    assert delays == [1, 2, 4, 8, 8]
    assert [line.split(";")[1].split(" on")[0] for line in lines] == [
        " restart 1 in 1 s", " restart 2 in 2 s", " restart 3 in 4 s", " restart 4 in 8 s",
        " restart 5 in 8 s"]
    clock.now += 60  # this run stays up stable_s
    cluster.children[0].status = -9
    sup.tick()
    assert sup.records["prefill-0"].due - clock.now == 1
    assert "restart 6 in 1 s" in lines[-1]


def test_a_restarted_child_that_never_prints_ready_is_killed_and_restarted():
    """A restart that hangs before READY (alive, never ready) is killed at ready_timeout_s,
    said once, and its death is one more failure: restarted after the next backoff."""
    clock, lines = Clock(), []
    killed: list[str] = []

    class Hanging(StubChild):
        def kill(self) -> None:
            killed.append(self.name)
            self.status = -9

    cluster = StubCluster(Hanging("prefill-0", 50123))
    cluster.restart = lambda child: _swap(cluster, child, Hanging(child.name, child.port))
    sup = Supervisor(cluster, Backoff(initial_s=1, max_s=8, stable_s=60), clock,
                     lines.append, ready_timeout_s=30)
    clock.now += 40
    sup.tick()                       # the first run is not timed here (baton up's start is)
    assert killed == []
    cluster.children[0].status = 1   # dies; restarted after 1 s
    sup.tick()
    clock.now += 1
    sup.tick()
    assert len(cluster.restarted) == 1
    clock.now += 29.9
    sup.tick()
    assert killed == []              # still inside its 30 s
    clock.now += 0.1
    sup.tick()
    assert killed == ["prefill-0"]
    assert "printed no READY in 30 s; killing it" in lines[-1]
    sup.tick()                       # its death: failure 2, restart in 2 s; not killed again
    assert killed == ["prefill-0"] and "restart 2 in 2 s" in lines[-1]
    clock.now += 2
    sup.tick()
    assert len(cluster.restarted) == 2
    cluster.children[0].ready.set()  # this one comes up: no kill, announced
    clock.now += 31
    sup.tick()
    assert killed == ["prefill-0"] and "is back on port 50123" in lines[-1]


def _swap(cluster: StubCluster, old: StubChild, new: StubChild) -> StubChild:
    cluster.children[cluster.children.index(old)] = new
    cluster.restarted.append((old.name, old.port))
    return new


def test_child_kill_ends_its_process_group(tmp_path):
    """Child.kill (the READY timeout's) SIGKILLs the real process; exited() then says so."""
    import os
    import time

    from baton.cluster.child import Child
    child = Child("hang", ["sleep", "30"], tmp_path / "hang.log")
    child.start(dict(os.environ))
    assert child.exited() is None
    child.kill()
    for _ in range(200):  # bounded: 10 s at most
        if child.exited() is not None:
            break
        time.sleep(0.05)
    assert child.exited() == -9
    child.kill()          # already dead: nothing to do, no error
