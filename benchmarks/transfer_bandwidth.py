"""KV transfer bandwidth between two processes, per transport, beside memcpy.

    python benchmarks/transfer_bandwidth.py [--transports nixl grpc] [--sizes-mib 1 16 256]

The receiver (decode side) runs in a spawned process; this process sends. Blocks are 1 MiB
(32 layers x K,V x 16 tokens x 4 KV heads x 64 dims, fp16) and moved between random,
non-adjacent block ids, so no two blocks merge into one descriptor. A transfer is timed from
send() until the sender sees DONE (for gRPC that is after the receiver acknowledged the last
byte; for NIXL after the WRITE completed, the notification follows). memcpy is one
torch copy_ of the same number of bytes in this process, with torch's threads and with one
(UCX moves a NIXL WRITE between local processes with one CMA copy, single-threaded); the
ratios compare with the faster of the two. Reported: median and best GiB/s of --reps timed
transfers after one warm-up.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

BLOCK_SHAPE = (32, 2, 16, 4, 64)  # [num_layers, 2, block_size, num_kv_heads, head_size]
DTYPE = "float16"                  # 1 MiB per block
MODEL = "bandwidth-bench"


def _cache(num_blocks: int, fill: bool):
    import torch

    shape = (num_blocks, *BLOCK_SHAPE)
    return torch.randn(shape, dtype=torch.float16) if fill else torch.zeros(shape, dtype=torch.float16)


def _receiver_main(kind: str, num_blocks: int, conn) -> None:
    asyncio.run(_serve(kind, num_blocks, conn))


async def _serve(kind: str, num_blocks: int, conn) -> None:
    import grpc

    from baton.transfer import kv_layout, make_receiver

    kv_cache = _cache(num_blocks, fill=False)
    receiver = make_receiver(kind, kv_cache, kv_layout(MODEL, kv_cache))
    server = None
    if kind == "grpc":
        server = grpc.aio.server()
        receiver.add_to_server(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        receiver.set_address(f"127.0.0.1:{port}")
    conn.send(receiver.endpoint().SerializeToString())
    loop = asyncio.get_running_loop()
    while (msg := await loop.run_in_executor(None, conn.recv))[0] == "expect":
        _, tid, dst = msg
        receiver.expect(tid, dst, timeout_s=120)
        conn.send("ok")
        while not (state := receiver.poll(tid)).finished:
            await asyncio.sleep(0.0005)
        checksum = float(kv_cache[dst].float().sum())
        receiver.forget(tid)
        conn.send((state.name, checksum))
    if server is not None:
        await server.stop(0)
    receiver.close()


def _bench_transport(kind: str, sizes_mib: list[int], reps: int) -> dict[int, list[float]]:
    import torch

    from baton.transfer import TransferState, kv_layout, make_sender
    from protos import transfer_pb2

    num_blocks = 2 * max(sizes_mib)
    src = _cache(num_blocks, fill=True)
    sender = make_sender(kind, src, kv_layout(MODEL, src))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(kind, num_blocks, child), daemon=True)
    proc.start()
    results: dict[int, list[float]] = {}
    try:
        endpoint = transfer_pb2.TransferEndpoint.FromString(conn.recv())
        gen = torch.Generator().manual_seed(0)
        for mib in sizes_mib:
            times = []
            for rep in range(reps + 1):  # rep 0 warms up (connection, page faults)
                ids = torch.randperm(num_blocks, generator=gen)[: 2 * mib]
                src_ids, dst_ids = ids[::2].tolist(), torch.randperm(num_blocks, generator=gen)[:mib].tolist()
                tid = f"{kind}-{mib}-{rep}"
                conn.send(("expect", tid, dst_ids))
                assert conn.recv() == "ok"
                t0 = time.perf_counter()
                sender.send(endpoint, tid, src_ids, dst_ids, timeout_s=120)
                state = sender.wait(tid, 120)
                elapsed = time.perf_counter() - t0
                remote_state, checksum = conn.recv()
                expected = float(src[src_ids].float().sum())  # same bits, same order: equal sums
                if state != TransferState.DONE or remote_state != "DONE" or checksum != expected:
                    raise RuntimeError(
                        f"{tid}: sender {state.name}, receiver {remote_state}, checksum {checksum} != {expected}")
                sender.forget(tid)
                if rep:
                    times.append(elapsed)
            results[mib] = [mib / 1024 / t for t in times]
    finally:
        sender.close()
        conn.send(("exit",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return results


def _bench_memcpy(sizes_mib: list[int], reps: int, threads: int) -> dict[int, list[float]]:
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = {}
    for mib in sizes_mib:
        src, dst = _cache(mib, fill=True), _cache(mib, fill=False)
        dst.copy_(src)  # page faults out of the way
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out[mib] = [mib / 1024 / t for t in times]
    torch.set_num_threads(saved)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["nixl", "grpc"], choices=["nixl", "grpc"])
    parser.add_argument("--sizes-mib", nargs="+", type=int, default=[1, 16, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ucx-net-devices", default="lo", help="UCX_NET_DEVICES for NIXL (both processes)")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", args.ucx_net_devices)  # before NIXL loads; inherited by the child

    import torch

    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")
    threads = torch.get_num_threads()
    reps = max(args.reps, 10)
    rows = {f"memcpy x{threads}": _bench_memcpy(args.sizes_mib, reps, threads),
            "memcpy x1": _bench_memcpy(args.sizes_mib, reps, 1)}
    # The reference: the faster thread count per size (on a busy machine, torch's parallel
    # copy can stall on thread wake-ups, and one thread cannot saturate memory).
    reference = {m: max(statistics.median(rows[k][m]) for k in list(rows)) for m in args.sizes_mib}
    for kind in args.transports:
        rows[kind] = _bench_transport(kind, args.sizes_mib, args.reps)
    print(f"\n{'GiB/s':<10}" + "".join(f"{f'{m} MiB median / best':>24}" for m in args.sizes_mib))
    for kind, by_size in rows.items():
        print(f"{kind:<10}" + "".join(f"{statistics.median(v):>14.2f} / {max(v):<7.2f}" for v in by_size.values()))
    for kind in args.transports:
        ratios = [statistics.median(rows[kind][m]) / reference[m] for m in args.sizes_mib]
        cells = ", ".join(f"{m} MiB {r:.0%}" for m, r in zip(args.sizes_mib, ratios))
        print(f"{kind} median / best memcpy median: {cells}")


if __name__ == "__main__":
    main()
