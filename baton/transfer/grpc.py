"""gRPC transport: the prefill worker streams packed blocks to the decode worker's KVTransfer.
This file: the protocol and `GrpcReceiver`; `GrpcSender` is in grpc_sender.py.

    prefill (GrpcSender)                                    decode (GrpcReceiver)
    pack_blocks(src ids) ─▶ KVChunk{dst ids, bytes} ──▶ PushBlocks ─▶ check, unpack_blocks
      ≤ chunk_bytes each, first chunk carries                into dst ids; DONE once every
      layout_hash + block_bytes                              expected byte is written
                          ◀── PushAck{complete} ────────── (or a gRPC status on refusal)

One PushBlocks stream carries one whole transfer; a stream that ends (or breaks) before every
block arrived fails the transfer. Blocks larger than a chunk travel as in-order slices.
PullBlocks goes the other way: the prefill worker reads blocks an expected transfer made
readable (its src_block_ids), chunked the same way (`pack_chunks`), each chunk checked still
readable once packed: nothing read after the decode side forgot the transfer goes out.

Threading: the receiver's servicer runs on the decode server's event loop; poll/expect/forget
may be called from any thread (one lock, held while a chunk is written, so forget() never
races a write). The sender owns a private asyncio loop on a daemon thread ("baton-kv-grpc")
with its channels; send() hands the stream to that loop and returns, so it works the same
from plain threads and from inside another event loop (use wait_async there).
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import AsyncIterator, Iterator

import grpc
import torch

from baton.transfer.base import KVReceiver, TransferState
from kernels.block_copy import pack_blocks, unpack_blocks
from protos import common_pb2, transfer_pb2, transfer_pb2_grpc

log = logging.getLogger(__name__)

# Payload per KVChunk: under gRPC's default 4 MiB receive limit, so the decode server needs
# no special options. (Throughput on loopback is flat from 1 to 8 MiB chunks.)
DEFAULT_CHUNK_BYTES = 2 << 20


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def from_bytes(data: bytes, device: torch.device) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffer: we only read from it
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8).to(device)


# -- decode side ---------------------------------------------------------------------------
def pack_chunks(kv_cache: torch.Tensor, block_bytes: int, chunk_bytes: int, src: list[int],
                dst: list[int], **fields) -> Iterator[transfer_pb2.KVChunk]:
    """KVChunks carrying blocks `src` of kv_cache as `dst` ids: whole blocks, or slices of one
    block when a block exceeds a chunk; `fields` go into the first chunk only (the layout
    hash and block size of a stream) and every chunk (request_id, transfer_id) as given:
    first={...} and every={...}."""
    first, every = fields.get("first", {}), fields.get("every", {})
    per_chunk = max(1, chunk_bytes // block_bytes)
    for i in range(0, len(src), per_chunk):
        ids = torch.tensor(src[i:i + per_chunk], dtype=torch.int64, device=kv_cache.device)
        data = as_bytes(pack_blocks(kv_cache, ids))
        step = len(data) if per_chunk > 1 or len(data) <= chunk_bytes else chunk_bytes
        for offset in range(0, len(data), step):
            yield transfer_pb2.KVChunk(dst_block_ids=dst[i:i + per_chunk], offset=offset,
                                       data=data[offset:offset + step], **every, **first)
            first = {}


def write_chunk(kv_cache: torch.Tensor, block_bytes: int, chunk: transfer_pb2.KVChunk,
                into: dict[int, int] | None, left: dict[int, int]) -> bool:
    """Write one chunk into kv_cache: whole blocks none of which was started, or the next
    in-order slice of one block. `into` maps the chunk's block ids to local ones (None: the
    same ids); `left`: local block → bytes still expected, updated. False, nothing written,
    when the chunk does not fit what is left."""
    ids = [into.get(b, -1) for b in chunk.dst_block_ids] if into is not None \
        else list(chunk.dst_block_ids)
    n = len(chunk.data)
    if not chunk.offset and n == len(ids) * block_bytes and len(set(ids)) == len(ids) \
            and all(left.get(b) == block_bytes for b in ids):
        buf = from_bytes(chunk.data, kv_cache.device).view(kv_cache.dtype)
        unpack_blocks(buf.view(len(ids), *kv_cache.shape[1:]), kv_cache,
                      torch.tensor(ids, dtype=torch.int64, device=kv_cache.device))
        for b in ids:
            del left[b]
        return True
    if len(ids) != 1 or not 0 < n <= left.get(ids[0], 0) \
            or chunk.offset != block_bytes - left[ids[0]]:
        return False
    b = ids[0]
    block = kv_cache[b].view(-1).view(torch.uint8)
    block[chunk.offset:chunk.offset + n].copy_(from_bytes(chunk.data, kv_cache.device))
    left[b] -= n
    if not left[b]:
        del left[b]
    return True


class _Servicer(transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, receiver: GrpcReceiver) -> None:
        self._receiver = receiver

    async def PushBlocks(self, request_iterator: AsyncIterator[transfer_pb2.KVChunk],
                         context: grpc.aio.ServicerContext) -> transfer_pb2.PushAck:
        return await self._receiver._serve_push(request_iterator, context)

    async def PullBlocks(self, request: transfer_pb2.PullRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[transfer_pb2.KVChunk]:
        async for chunk in self._receiver._serve_pull(request, context):
            yield chunk


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

    async def _serve_pull(self, req: transfer_pb2.PullRequest,
                          context) -> AsyncIterator[transfer_pb2.KVChunk]:
        """The requested readable blocks, chunked; a refusal aborts the call."""
        tid, src = req.transfer_id, list(req.src_block_ids)
        if req.layout_hash != self.layout_hash or req.block_bytes != self.block_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "pull: KV layout or block size differs from the receiver's")
        for chunk in pack_chunks(self.kv_cache, self.block_bytes, DEFAULT_CHUNK_BYTES, src, src,
                                 every={"request_id": req.request_id, "transfer_id": tid}):
            if not self.readable(tid, chunk.dst_block_ids):  # forgotten meanwhile: stop
                log.warning("refused KV pull %r: blocks %s not readable", tid,
                            list(chunk.dst_block_ids))
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"transfer {tid!r} does not make these blocks readable")
            yield chunk

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
            if not write_chunk(self.kv_cache, self.block_bytes, chunk, None, left):
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

    def _fail(self, tid: str | None) -> None:
        with self._lock:
            t = self._transfers.get(tid)
            if t is not None and not t.state.finished:
                t.state = TransferState.FAILED
            self._remaining.pop(tid, None)

