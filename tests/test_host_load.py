"""Other programs' load caps a sharing worker's threads (baton/worker/host_load.py)."""
import os

from baton.worker.cpu_share import CpuShare, create_share_file
from baton.worker.host_load import (
    HostLoad,
    affinity_busy_seconds,
    host_busy_seconds,
    process_cpu_seconds,
)


class Fake:
    """Settable readings: host busy seconds, own CPU seconds, other workers', time."""

    def __init__(self) -> None:
        self.t, self.host, self.own, self.others = 0.0, 100.0, 10.0, {7: 5.0}

    def load(self, window_s: float = 0.5) -> HostLoad:
        return HostLoad(window_s, host=lambda: self.host, own=lambda: self.own,
                        others=lambda: dict(self.others), clock=lambda: self.t)


def test_external_cores_are_the_hosts_busy_time_less_baton_workers():
    f = Fake()
    load = f.load()
    # a program busy on one core for a second, this worker on 0.5, the other worker on 0.1
    f.t, f.host, f.own, f.others = 1.0, 101.6, 10.5, {7: 5.1}
    assert abs(load.sample() - 1.0) < 1e-9 and load.cap(2) == 1
    f.t += 0.2  # within the window: the last figure, nothing read
    f.host += 5.0
    assert abs(load.sample() - 1.0) < 1e-9
    # the program ended: the host's busy time is this worker's alone
    f.t, f.host, f.own = 2.0, 106.6 + 1.5, 10.5 + 1.5
    load.sample()
    f.t, f.host, f.own = 3.0, f.host + 1.8, f.own + 1.8
    assert load.sample() == 0.0 and load.cap(2) == 2 and load.cap(4) == 4


def test_a_worker_restarting_counts_nothing_and_unknown_host_changes_nothing():
    f = Fake()
    load = f.load()
    f.t, f.host, f.own, f.others = 1.0, 101.2, 10.2, {8: 300.0}  # pid 7 gone, 8 new
    assert abs(load.sample() - 1.0) < 1e-9  # 1.2 busy − 0.2 own; the new pid counts 0
    f.host = None
    f.t = 2.0
    assert abs(load.sample() - 1.0) < 1e-9  # unreadable: the last figure stays
    assert load.cap(1) == 1  # never below one thread


def test_the_share_takes_the_smaller_of_both_rules(tmp_path):
    path = create_share_file(tmp_path / "share", 2)
    f = Fake()
    a = CpuShare(path, 0, cpus=2, load=f.load())
    b = CpuShare(path, 1, cpus=2)
    assert a.threads_for_step() == 2  # b idle, nothing else busy
    f.t, f.host, f.own = 1.0, 101.0, 10.3  # another program on 0.7 of a core
    assert a.threads_for_step() == 1
    f.t, f.host, f.own = 2.0, f.host + 1.0, f.own + 1.0
    assert a.threads_for_step() == 2
    b.threads_for_step()  # b busy: one core each, whatever the load says
    assert a.threads_for_step() == 1
    assert a.other_pids() == [os.getpid()] == b.other_pids()  # both in this process here
    a.close()
    b.close()


def test_the_real_readers(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 4000 50 6 7 800 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert host_busy_seconds(str(stat)) == (100 + 20 + 30 + 6 + 7) / tick  # no idle/iowait/steal
    assert host_busy_seconds(str(stat), cpus=[0]) == (1 + 2 + 3 + 6 + 7) / tick
    assert host_busy_seconds(str(stat), cpus=[5]) is None  # a core the file does not list
    assert host_busy_seconds(str(tmp_path / "missing")) is None
    assert host_busy_seconds() is not None  # this Linux host's
    assert affinity_busy_seconds() is not None
    sum(i * i for i in range(200_000))  # spend a little CPU
    mine = process_cpu_seconds([os.getpid(), 2**22 + 12345])
    assert list(mine) == [os.getpid()] and mine[os.getpid()] > 0
    load = HostLoad(window_s=0.0)
    assert load.sample() >= 0.0 and 1 <= load.cap(2) <= 2
