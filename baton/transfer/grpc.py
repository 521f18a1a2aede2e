"""gRPC transport: the prefill worker streams packed blocks to the decode worker's KVTransfer.

    prefill (GrpcSender)                                    decode (GrpcReceiver)
    pack_blocks(src ids) ─▶ KVChunk{dst ids, bytes} ──▶ PushBlocks ─▶ check, unpack_blocks
      ≤ chunk_bytes each, first chunk carries                into dst ids; DONE once every
      layout_hash + block_bytes                              expected byte is written
                          ◀── PushAck{complete} ────────── (or a gRPC status on refusal)

One PushBlocks stream carries one whole transfer; a stream that ends (or breaks) before every
block arrived fails the transfer. Blocks larger than a chunk travel as in-order slices.

Threading: the receiver's servicer runs on the decode server's event loop; poll/expect/forget
may be called from any thread (one lock, held while a chunk is written, so forget() never
races a write). The sender owns a private asyncio loop on a daemon thread ("baton-kv-grpc")
with its channels; send() hands the stream to that loop and returns, so it works the same
from plain threads and from inside another event loop (use wait_async there).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import torch

from baton.grpc_options import CHANNEL_OPTIONS
from baton.transfer.base import KVReceiver, KVSender, TransferState
from kernels.block_copy import pack_blocks, unpack_blocks
from protos import common_pb2, transfer_pb2, transfer_pb2_grpc

log = logging.getLogger(__name__)

# Payload per KVChunk: under gRPC's default 4 MiB receive limit, so the decode server needs
# no special options. (Throughput on loopback is flat from 1 to 8 MiB chunks.)
DEFAULT_CHUNK_BYTES = 2 << 20


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _from_bytes(data: bytes, device: torch.device) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffer: we only read from it
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8).to(device)


# -- decode side ---------------------------------------------------------------------------
class _Servicer(transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, receiver: GrpcReceiver) -> None:
        self._receiver = receiver

    async def PushBlocks(self, request_iterator: AsyncIterator[transfer_pb2.KVChunk],
                         context: grpc.aio.ServicerContext) -> transfer_pb2.PushAck:
        return await self._receiver._serve_push(request_iterator, context)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class GrpcReceiver(KVReceiver):
    """Decode side. add_to_server(server) before the server starts; `address` (host:port that
    senders dial) may come later through set_address, once the port is bound."""

    refuses_late_writes = True  # chunks for a forgotten transfer are refused

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, address: str | None = None) -> None:
        super().__init__(kv_cache, layout)
        self.address = address
        self._remaining: dict[str, dict[int, int]] = {}  # transfer id -> dst block -> bytes left
        self._closed = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        transfer_pb2_grpc.add_KVTransferServicer_to_server(_Servicer(self), server)

    def set_address(self, address: str) -> None:
        self.address = address

    def endpoint(self) -> transfer_pb2.TransferEndpoint:
        if not self.address:
            raise RuntimeError("GrpcReceiver has no address yet: call set_address(host:port)")
        return self._endpoint(grpc=transfer_pb2.GrpcEndpoint(address=self.address))

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._transfers.pop(transfer_id, None)
            self._remaining.pop(transfer_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    async def _serve_push(self, chunks: AsyncIterator[transfer_pb2.KVChunk], context) -> transfer_pb2.PushAck:
        tid, ack = None, transfer_pb2.PushAck()
        try:
            async for chunk in chunks:
                if tid is None:
                    tid = ack.transfer_id = chunk.transfer_id
                    self._check_first(chunk)
                elif chunk.transfer_id != tid:
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "one stream carries one transfer")
                ack.complete = self._write(tid, chunk)
                ack.num_blocks += len(chunk.dst_block_ids) if chunk.offset == 0 else 0
                ack.num_bytes += len(chunk.data)
            if tid is None:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty PushBlocks stream")
            if not ack.complete:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"stream ended before transfer {tid!r} completed")
        except _Refused as e:
            self._fail(tid)
            log.warning("refused KV push %r: %s", tid, e.details)
            await context.abort(e.code, e.details)
        except BaseException:  # the sender went away (CancelledError) or the server stops
            self._fail(tid)
            raise
        return ack

    def _check_first(self, chunk: transfer_pb2.KVChunk) -> None:
        if chunk.layout_hash != self.layout_hash:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"KV layout hash {chunk.layout_hash:016x} != receiver's {self.layout_hash:016x}")
        if chunk.block_bytes != self.block_bytes:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"block of {chunk.block_bytes} bytes != receiver's {self.block_bytes}")

    def _write(self, tid: str, chunk: transfer_pb2.KVChunk) -> bool:
        """Write one chunk into the kv_cache; True when the transfer is now complete."""
        with self._lock:
            t = self._transfers.get(tid)
            if self._closed:
                raise _Refused(grpc.StatusCode.UNAVAILABLE, "receiver closed")
            if t is None:
                raise _Refused(grpc.StatusCode.NOT_FOUND, f"transfer {tid!r} is not expected")
            if t.state.finished:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, f"transfer {tid!r} is already {t.state.name}")
            left = self._remaining.setdefault(tid, dict.fromkeys(t.dst_block_ids, self.block_bytes))
            t.state = TransferState.IN_PROGRESS
            if not (self._write_blocks(chunk, left) or self._write_slice(chunk, left)):
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"chunk (blocks {list(chunk.dst_block_ids)}, offset {chunk.offset}, "
                               f"{len(chunk.data)} bytes) does not fit what transfer {tid!r} still expects")
            if left:
                return False
            if self.kv_cache.is_cuda:  # DONE only once the copies have really landed
                torch.cuda.synchronize(self.kv_cache.device)
            t.state = TransferState.DONE
            del self._remaining[tid]
            return True

    def _write_blocks(self, chunk: transfer_pb2.KVChunk, left: dict[int, int]) -> bool:
        """Whole blocks, none of them started yet: unpack them all. False if it is not that."""
        ids = list(chunk.dst_block_ids)
        if chunk.offset or len(chunk.data) != len(ids) * self.block_bytes or len(set(ids)) != len(ids) \
                or any(left.get(b) != self.block_bytes for b in ids):
            return False
        buf = _from_bytes(chunk.data, self.kv_cache.device).view(self.kv_cache.dtype)
        unpack_blocks(buf.view(len(ids), *self.kv_cache.shape[1:]), self.kv_cache,
                      torch.tensor(ids, dtype=torch.int64, device=self.kv_cache.device))
        for b in ids:
            del left[b]
        return True

    def _write_slice(self, chunk: transfer_pb2.KVChunk, left: dict[int, int]) -> bool:
        """The next in-order slice of one block. False if it is not that."""
        if len(chunk.dst_block_ids) != 1:
            return False
        b, n = chunk.dst_block_ids[0], len(chunk.data)
        if not 0 < n <= left.get(b, 0) or chunk.offset != self.block_bytes - left[b]:
            return False
        block = self.kv_cache[b].view(-1).view(torch.uint8)
        block[chunk.offset:chunk.offset + n].copy_(_from_bytes(chunk.data, self.kv_cache.device))
        left[b] -= n
        if not left[b]:
            del left[b]
        return True

    def _fail(self, tid: str | None) -> None:
        with self._lock:
            t = self._transfers.get(tid)
            if t is not None and not t.state.finished:
                t.state = TransferState.FAILED
            self._remaining.pop(tid, None)


# -- prefill side --------------------------------------------------------------------------
@dataclass
class _Push:
    deadline: float
    state: TransferState = TransferState.IN_PROGRESS
    future: concurrent.futures.Future | None = None


class GrpcSender(KVSender):
    """Prefill side. chunk_bytes: payload bytes per KVChunk (keep under the receiving
    server's max_receive_message_length, 4 MiB by default)."""

    transport = "grpc"

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(kv_cache, layout)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be ≥ 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._xfers: dict[str, _Push] = {}
        self._stubs: dict[str, tuple[grpc.aio.Channel, transfer_pb2_grpc.KVTransferStub]] = {}  # loop thread only
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="baton-kv-grpc", daemon=True)
        self._thread.start()

    def _start(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("GrpcSender is closed")
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Push(deadline)
            if not src:
                x.state = TransferState.DONE
                return
            chunks = self._chunks(request_id, transfer_id, src, dst)
            coro = self._push(endpoint.grpc.address, transfer_id, chunks, x)
            x.future = asyncio.run_coroutine_threadsafe(coro, self._loop)

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            x = self._xfers[transfer_id]
            # Backstop only: the call's own deadline normally ends it first.
            if not x.state.finished and time.monotonic() > x.deadline + 1.0:
                x.future.cancel()
                x.state = TransferState.FAILED
            return x.state

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            x = self._xfers.pop(transfer_id, None)
        if x is not None and x.future is not None:
            x.future.cancel()

    def close(self) -> None:
        with self._lock:
            if self._loop.is_closed():
                return
            for x in self._xfers.values():
                if not x.state.finished:
                    x.state = TransferState.CANCELLED
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5.0)
        except Exception as e:
            log.warning("closing GrpcSender: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel, _ in self._stubs.values():
            await channel.close(grace=None)
        self._stubs.clear()

    def _chunks(self, request_id: str, tid: str, src: list[int], dst: list[int]) -> Iterator[transfer_pb2.KVChunk]:
        """KVChunks of whole blocks (or slices of one block when a block exceeds a chunk)."""
        first = {"layout_hash": self.layout_hash, "block_bytes": self.block_bytes}
        per_chunk = max(1, self.chunk_bytes // self.block_bytes)
        for i in range(0, len(src), per_chunk):
            ids = torch.tensor(src[i:i + per_chunk], dtype=torch.int64, device=self.kv_cache.device)
            data = _as_bytes(pack_blocks(self.kv_cache, ids))
            step = len(data) if per_chunk > 1 or len(data) <= self.chunk_bytes else self.chunk_bytes
            for offset in range(0, len(data), step):
                yield transfer_pb2.KVChunk(
                    request_id=request_id, transfer_id=tid, dst_block_ids=dst[i:i + per_chunk], offset=offset,
                    data=data[offset:offset + step], **first)
                first = {}

    async def _push(self, address: str, tid: str, chunks: Iterator[transfer_pb2.KVChunk], x: _Push) -> None:
        state = TransferState.FAILED
        try:
            timeout = max(0.0, x.deadline - time.monotonic())
            ack = await self._stub(address).PushBlocks(_aiter(chunks), timeout=timeout)
            state = TransferState.DONE if ack.complete else TransferState.FAILED
        except asyncio.CancelledError:
            state = TransferState.CANCELLED
            raise
        except grpc.aio.AioRpcError as e:
            log.warning("KV push %s to %s failed: %s %s", tid, address, e.code().name, e.details())
        except Exception:
            log.exception("KV push %s to %s failed", tid, address)
        finally:
            with self._lock:
                if not x.state.finished:
                    x.state = state

    def _stub(self, address: str) -> transfer_pb2_grpc.KVTransferStub:
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._stubs[address] = (channel, transfer_pb2_grpc.KVTransferStub(channel))
        return self._stubs[address][1]


async def _aiter(chunks: Iterator[transfer_pb2.KVChunk]) -> AsyncIterator[transfer_pb2.KVChunk]:
    for chunk in chunks:  # packing runs here, on the sender's loop thread, one chunk at a time
        yield chunk
