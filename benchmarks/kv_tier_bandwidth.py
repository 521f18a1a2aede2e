"""KV tier bandwidth: save and load blocks per tier and per mover, beside memcpy and the
disk's own sequential bandwidth, all measured in the same run.

    python benchmarks/kv_tier_bandwidth.py [--sizes-mib 1 16 256] [--dir /tmp] [--reps 3]

Blocks are SmolLM2-135M's (30 layers x K,V x 16 tokens x 3 KV heads x 64 dims, fp32 =
720 KiB); a size is rounded to whole blocks. Block ids are a random permutation, so no
two neighbours are adjacent in the pool. Movers:
- memcpy:        one copy of the same bytes, torch copy_ (its threads) and numpy (one
                 thread): the ceiling for host moves
- host/tier:     KVTier's host tier as the engine runs it: one memcpy per block into a slot
- host/nixl:     NIXL UCX, one loopback READ/WRITE of all blocks (pool and host store
                 registered as DRAM), descriptor preparation included
- disk/tier:     KVTier's disk tier: one file per block, header + CRC-32, writev / readinto
- disk/pwrite:   os.pwrite / os.preadv of each block into its file, kept open (no header,
                 no CRC, no create): the plain-I/O twin of disk/nixl
- disk/nixl:     NIXL POSIX, one transfer of all blocks to / from the same open files
- disk/torch.save: torch.save / torch.load of each block
Loads are timed twice: "warm" right after the save (page cache), "cold" after each file's
pages were dropped (fsync + POSIX_FADV_DONTNEED), which is the device. Saves are timed up to
the last write returning (page cache; no fsync), as the engine does. disk/seq: one file of
the size written + fsync'd, then read cold: the device's own sequential bandwidth.
Prints GiB/s (median of --reps) and the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from baton.engine.block_pool import Block  # noqa: E402
from baton.engine.kv_tier import KVTier  # noqa: E402
from baton.engine.tier_store import as_bytes  # noqa: E402

BLOCK_SHAPE = (30, 2, 16, 3, 64)
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


def _timed(fn, reps: int, setup=None) -> float:
    """Median seconds of `reps` calls of fn() (setup() before each, untimed)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Bench:
    """One size: a pool of `n` blocks (filled), a permutation of their ids, a scratch dir."""

    def __init__(self, n: int, root: str, reps: int) -> None:
        self.n, self.reps = n, reps
        self.pool = torch.randn(n, *BLOCK_SHAPE)
        self.ids = torch.randperm(n).tolist()
        self.dir = tempfile.mkdtemp(prefix="kv-tier-bench-", dir=root)
        self.paths = [os.path.join(self.dir, f"{i}.bin") for i in range(n)]
        self.rows: list[tuple[str, float, float, float | None]] = []

    def gibs(self, seconds: float) -> float:
        return self.n * BLOCK_BYTES / seconds / 2**30

    def add(self, name: str, save_s: float, warm_s: float, cold_s: float | None) -> None:
        self.rows.append((name, self.gibs(save_s), self.gibs(warm_s),
                          None if cold_s is None else self.gibs(cold_s)))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- host ----------------------------------------------------------------------------
    def memcpy(self) -> None:
        dst = torch.empty_like(self.pool)
        dst.copy_(self.pool)  # fault the pages in once
        s = _timed(lambda: dst.copy_(self.pool), self.reps)
        self.add(f"memcpy/torch ({torch.get_num_threads()} thr)", s, s, None)
        d, src = as_bytes(dst), as_bytes(self.pool)
        s = _timed(lambda: np.copyto(d, src), self.reps)
        self.add("memcpy/numpy (1 thr)", s, s, None)

    def host_tier(self) -> None:
        tier = KVTier(self.pool, host_bytes=self.n * BLOCK_BYTES)
        blocks = [Block(b, 0, b + 1, (b,)) for b in self.ids]

        def save():
            tier.offload(blocks)

        def reset():
            for b in blocks:
                if b.block_hash in tier.host:
                    tier.host.free_slot(tier.host.take(b.block_hash))

        def load():
            for b in blocks:
                tier.finish(tier.claim(b.block_hash, (b.block_id,)), b.block_id)

        save_s = _timed(save, self.reps, reset)
        load_s = _timed(load, self.reps, lambda: (reset(), save()))
        self.add("host/tier", save_s, load_s, None)

    def host_nixl(self) -> None:
        from baton.transfer.nixl import make_agent

        agent = make_agent("tier-bench", None)
        store = torch.empty_like(self.pool)
        regs = [agent.register_memory(t) for t in (self.pool, store)]
        pool_d = [(self.pool[b].data_ptr(), BLOCK_BYTES, 0) for b in self.ids]
        store_d = [(store[i].data_ptr(), BLOCK_BYTES, 0) for i in range(self.n)]

        def move(op: str):
            h = agent.initialize_xfer(op, agent.get_xfer_descs(pool_d, "DRAM"),
                                      agent.get_xfer_descs(store_d, "DRAM"), agent.name)
            _wait(agent, h)

        save_s = _timed(lambda: move("WRITE"), self.reps)
        load_s = _timed(lambda: move("READ"), self.reps)
        assert torch.equal(store[0], self.pool[self.ids[0]])
        for r in regs:
            agent.deregister_memory(r)
        self.add("host/nixl", save_s, load_s, None)

    # ---- disk ----------------------------------------------------------------------------
    def disk_tier(self) -> None:
        tier = KVTier(self.pool, disk_dir=self.dir, disk_bytes=2 * self.n * (BLOCK_BYTES + 4096))
        disk = tier.disk
        blocks = [Block(b, 0, b + 1, tuple(range(16))) for b in self.ids]

        def reset():
            for b in blocks:
                if b.block_hash in disk:
                    disk.drop(b.block_hash)

        def load():
            for b in blocks:
                tier.finish(tier.claim(b.block_hash, b.token_ids), b.block_id)

        paths = lambda: [disk.path(b.block_hash) for b in blocks]  # noqa: E731
        save_s = _timed(lambda: tier.offload(blocks), self.reps, reset)
        warm_s = _timed(load, self.reps)
        cold_s = _timed(load, self.reps, lambda: _drop_cache(paths()))
        assert tier.disk_totals.dropped_blocks == 0
        self.add("disk/tier", save_s, warm_s, cold_s)

    def disk_pwrite(self) -> None:
        views = [as_bytes(self.pool[b]) for b in self.ids]
        fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths]

        def save():
            for fd, v in zip(fds, views):
                os.pwrite(fd, v, 0)

        def load():
            for fd, v in zip(fds, views):
                os.preadv(fd, [v], 0)

        try:
            self._disk_rows("disk/pwrite", save, load)
        finally:
            for fd in fds:
                os.close(fd)

    def disk_nixl(self) -> None:
        from baton.transfer.nixl import ucx_env_without_rdma
        ucx_env_without_rdma()
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(f"tier-bench-posix-{os.getpid()}",
                           nixl_agent_config(backends=["POSIX"], enable_prog_thread=False))
        fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths]
        reg = agent.register_memory(self.pool)
        freg = agent.register_memory([(0, BLOCK_BYTES, fd, "") for fd in fds], "FILE")
        dram = [(self.pool[b].data_ptr(), BLOCK_BYTES, 0) for b in self.ids]
        files = [(0, BLOCK_BYTES, fd) for fd in fds]

        def move(op: str):
            h = agent.initialize_xfer(op, agent.get_xfer_descs(dram, "DRAM"),
                                      agent.get_xfer_descs(files, "FILE"), agent.name)
            _wait(agent, h)

        try:
            self._disk_rows("disk/nixl", lambda: move("WRITE"), lambda: move("READ"))
        finally:
            agent.deregister_memory(freg)
            agent.deregister_memory(reg)
            for fd in fds:
                os.close(fd)

    def disk_torch_save(self) -> None:
        def save():
            for p, b in zip(self.paths, self.ids):
                torch.save(self.pool[b].clone(), p)  # a view would save the whole pool

        def load():
            for p, b in zip(self.paths, self.ids):
                self.pool[b].copy_(torch.load(p))

        self._disk_rows("disk/torch.save", save, load)

    def _disk_rows(self, name: str, save, load) -> None:
        save_s = _timed(save, self.reps)
        warm_s = _timed(load, self.reps)
        cold_s = _timed(load, self.reps, lambda: _drop_cache(self.paths))
        self.add(name, save_s, warm_s, cold_s)

    def disk_seq(self) -> None:
        path = os.path.join(self.dir, "seq.bin")
        data = as_bytes(self.pool)

        def write():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, data)
            os.fsync(fd)
            os.close(fd)

        def read():
            with open(path, "rb", buffering=0) as f:
                f.readinto(data)

        w = _timed(write, self.reps)
        r = _timed(read, self.reps, lambda: _drop_cache([path]))
        self.add("disk/seq (fsync, cold)", w, r, r)


def _wait(agent, handle) -> None:
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended {state}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier writes")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], help="movers to skip, e.g. host_nixl")
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()}; torch threads {torch.get_num_threads()}; "
          f"block {BLOCK_BYTES} B; dir {a.dir}")
    movers = ["memcpy", "host_tier", "host_nixl", "disk_tier", "disk_pwrite", "disk_nixl",
              "disk_torch_save", "disk_seq"]
    print(f"{'MiB':>7} {'mover':<24} {'save GiB/s':>10} {'load warm':>10} {'load cold':>10}")
    for mib in a.sizes_mib:
        n = max(1, round(mib * 2**20 / BLOCK_BYTES))
        if shutil.disk_usage(a.dir).free < 4 * n * BLOCK_BYTES:
            raise SystemExit(f"{a.dir}: less than 4x {mib} MiB free")
        bench = Bench(n, a.dir, a.reps)
        try:
            for m in movers:
                if m not in a.skip:
                    getattr(bench, m)()
        finally:
            bench.close()
        for name, save, warm, cold in bench.rows:
            cold_s = f"{cold:10.2f}" if cold is not None else f"{'-':>10}"
            print(f"{n * BLOCK_BYTES / 2**20:7.1f} {name:<24} {save:10.2f} {warm:10.2f} {cold_s}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
