"""Small KV caches and a receiver that runs in another process, for the transport tests."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import torch

from baton.transfer import kv_layout, make_receiver

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]: 1 KiB fp32 blocks.
SHAPE = (32, 2, 2, 4, 2, 8)
MODEL = "tiny-test-model"


def random_cache(seed: int, shape=SHAPE, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def assert_moved(dst: torch.Tensor, before: torch.Tensor, src: torch.Tensor, src_ids, dst_ids) -> None:
    """dst blocks dst_ids hold src blocks src_ids bit for bit; every other block is unchanged."""
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[d].view(torch.uint8), src[s].view(torch.uint8)), f"block {s} -> {d} differs"
    others = [b for b in range(dst.shape[0]) if b not in set(dst_ids)]
    assert torch.equal(dst[others].view(torch.uint8), before[others].view(torch.uint8)), "untouched blocks changed"


class RemoteReceiver:
    """A receiver of `kind` in a spawned process, driven over a pipe. Its kv_cache is zeros."""

    def __init__(self, kind: str, shape=SHAPE, dtype=torch.float32) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(kind, child, shape, dtype), daemon=True)
        self.proc.start()
        self.endpoint_bytes = self._recv(timeout=60)

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("remote receiver did not answer")
        return self.conn.recv()

    def expect(self, tid: str, dst_ids, timeout_s: float | None = None) -> None:
        self.conn.send(("expect", tid, list(dst_ids), timeout_s))
        assert self._recv(10) == "ok"

    def wait(self, tid: str, timeout_s: float):
        """(final state name, the remote kv_cache) once the transfer ended or timeout_s passed."""
        self.conn.send(("wait", tid, timeout_s))
        return self._recv(timeout_s + 10)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _receiver_main(kind: str, conn, shape, dtype) -> None:
    torch.set_num_threads(1)
    asyncio.run(_serve(kind, conn, shape, dtype))


async def _serve(kind: str, conn, shape, dtype) -> None:
    import grpc

    kv_cache = torch.zeros(shape, dtype=dtype)
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
    while (msg := await loop.run_in_executor(None, conn.recv))[0] != "exit":
        if msg[0] == "expect":
            receiver.expect(msg[1], msg[2], msg[3])
            conn.send("ok")
        elif msg[0] == "wait":
            deadline = time.monotonic() + msg[2]
            while not (state := receiver.poll(msg[1])).finished and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            conn.send((state.name, kv_cache.clone()))
    if server is not None:
        await server.stop(0)
    receiver.close()
