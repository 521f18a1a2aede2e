"""gpu_check section `nixl`: Baton's NIXL transport between two processes on one device.

    parent ──pipe──▶ receiver process: kv_cache zeros on the device, NixlReceiver
           ──pipe──▶ sender process:   kv_cache seeded random on the device, NixlSender
    per round: receiver.expect(dst) → sender.send(src → dst), timed to DONE → receiver digests
    its dst blocks; the parent checks them against the same seeded cache built on the host.

On CUDA the caches are VRAM (NIXL / UCX move them device to device, CUDA IPC on one GPU);
in the dry-run DRAM. SKIP where `nixl` (or the generated protos) does not import: the GPU
image has no nixl; carry its wheels as BENCHMARKS.md "GPU readiness" says.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import time

import torch

from gpu_check import FAIL, PASS, SKIP, log

MODEL = "gpu-check"
# [num_blocks, layers, 2, block_size, kv_heads, head_size]: Llama-3.2-1B's, 512 KiB bf16 blocks
SHAPE_GPU, SHAPE_DRY = (1024, 16, 2, 16, 8, 64), (32, 2, 2, 4, 2, 8)
ROUNDS, TIMEOUT_S = 3, 60.0


def _cache(shape, dtype, seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _digest(kv: torch.Tensor, ids) -> str:
    return hashlib.sha256(kv[list(ids)].cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def _child(role: str, conn, device: str, shape, dtype) -> None:
    """Serve the parent's messages as the receiver or the sender until ("exit",)."""
    from baton.transfer import kv_layout, make_receiver, make_sender
    from protos import transfer_pb2

    torch.set_num_threads(1)
    kv = _cache(shape, dtype, None if role == "recv" else 1).to(device)
    if role == "recv":
        side = make_receiver("nixl", kv, kv_layout(MODEL, kv))
        conn.send(side.endpoint().SerializeToString())
    else:
        side = make_sender("nixl", kv, kv_layout(MODEL, kv))
        conn.send("ready")
    try:
        while (msg := conn.recv())[0] != "exit":
            if msg[0] == "expect":
                side.expect(msg[1], msg[2], TIMEOUT_S)
                conn.send("ok")
            elif msg[0] == "wait":  # receiver: final state, digest of its dst blocks
                deadline = time.monotonic() + TIMEOUT_S
                while not (state := side.poll(msg[1])).finished and time.monotonic() < deadline:
                    time.sleep(0.0005)
                conn.send((state.name, _digest(kv, msg[2])))
            elif msg[0] == "send":  # sender: seconds from send() to DONE
                ep = transfer_pb2.TransferEndpoint.FromString(msg[1])
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                side.send(ep, msg[2], msg[3], msg[4], timeout_s=TIMEOUT_S)
                state = side.wait(msg[2], TIMEOUT_S)
                conn.send((state.name, time.perf_counter() - t0))
    finally:
        side.close()


class _Proc:
    def __init__(self, ctx_mp, role: str, device: str, shape, dtype) -> None:
        self.conn, child = ctx_mp.Pipe()
        self.proc = ctx_mp.Process(target=_child, args=(role, child, device, shape, dtype),
                                   daemon=True, name=f"gpu-check-nixl-{role}")
        self.proc.start()

    def ask(self, msg=None, timeout: float = TIMEOUT_S + 30):
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name} did not answer in {timeout:.0f} s")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def section_nixl(ctx) -> tuple[str, str]:
    try:
        import nixl._api  # noqa: F401
        import baton.transfer.nixl  # noqa: F401 - protos too
    except Exception as e:  # noqa: BLE001 - ImportError, or a protobuf gencode mismatch
        return SKIP, f"nixl does not import here ({type(e).__name__}: {str(e)[:160]})"
    shape = SHAPE_DRY if ctx.dry_run else SHAPE_GPU
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    device = str(ctx.device)
    spawn = mp.get_context("spawn")
    recv, send = (_Proc(spawn, r, device, shape, dtype) for r in ("recv", "send"))
    try:
        endpoint = recv.ask()
        assert send.ask() == "ready"
        host_src = _cache(shape, dtype, 1)
        block_bytes = host_src[0].numel() * host_src.element_size()
        n = shape[0] // 2
        best, rounds = None, []
        for r in range(ROUNDS):
            g = torch.Generator().manual_seed(100 + r)
            src = torch.randperm(shape[0], generator=g)[:n].tolist()
            dst = torch.randperm(shape[0], generator=g)[:n].tolist()
            tid = f"gpu-check-{r}"
            assert recv.ask(("expect", tid, dst)) == "ok"
            state, seconds = send.ask(("send", endpoint, tid, src, dst))
            recv_state, digest = recv.ask(("wait", tid, dst))
            ok = state == recv_state == "DONE" and digest == _digest(host_src, src)
            gbs = n * block_bytes / seconds / 1e9
            rounds.append({"state": state, "receiver": recv_state, "bit_exact": ok,
                           "seconds": seconds, "gb_s": gbs})
            log(f"round {r}: {n} blocks ({n * block_bytes / 2**20:.0f} MiB) {state}/{recv_state} "
                f"in {seconds * 1e3:.1f} ms = {gbs:.2f} GB/s, bytes {'equal' if ok else 'DIFFER'}")
            if not ok:
                ctx.report["nixl"] = {"rounds": rounds}
                return FAIL, f"round {r}: sender {state}, receiver {recv_state}, bit_exact {ok}"
            best = max(best or 0.0, gbs)
        ctx.report["nixl"] = {"rounds": rounds, "memory": "VRAM" if ctx.device.type == "cuda"
                              else "DRAM"}
        where = "device to device" if ctx.device.type == "cuda" else "host to host (dry-run)"
        return PASS, f"{where} between two processes, bit-exact, best {best:.2f} GB/s"
    finally:
        recv.stop()
        send.stop()
