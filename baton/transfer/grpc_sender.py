"""gRPC transport, prefill side: `GrpcSender` streams packed blocks to the decode worker's
KVTransfer service on a private asyncio loop (see grpc.py for the protocol and threading).

Streamed transfers (begin/push): the PushBlocks stream opens at begin(); each push() queues
its (src, dst) blocks to the loop, where they are packed and sent as they come; the push
that reaches the last dst block closes the request stream. The receiver sees an ordinary
transfer (it accepts any not-yet-written whole blocks in any chunk)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import torch

from baton.grpc_options import CHANNEL_OPTIONS
from baton.transfer.base import KVSender, TransferState, pull_id
from baton.transfer.grpc import DEFAULT_CHUNK_BYTES, pack_chunks, write_chunk
from protos import common_pb2, transfer_pb2, transfer_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class _Push:
    deadline: float
    state: TransferState = TransferState.IN_PROGRESS
    future: concurrent.futures.Future | None = None
    dst: list[int] | None = None      # streamed: every dst block; the rest come by push()
    pushed: int = 0                   # streamed: dst blocks handed to the loop so far
    parts: asyncio.Queue | None = None  # streamed: (src, dst) parts, None ends (loop thread)
    task: asyncio.Task | None = None  # streamed: the push task, once it runs (loop thread)
    cancelled: bool = False           # streamed: cancel() came (loop thread)


class GrpcSender(KVSender):
    """Prefill side. chunk_bytes: payload bytes per KVChunk (keep under the receiving
    server's max_receive_message_length, 4 MiB by default)."""

    transport = "grpc"
    streams = True

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
            chunks = self._chunks(request_id, transfer_id, src, dst, True)
            coro = self._push(endpoint.grpc.address, transfer_id, _aiter(chunks), x)
            x.future = asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _begin(self, endpoint, transfer_id, dst, request_id, deadline) -> None:
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("GrpcSender is closed")
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Push(deadline, dst=dst, parts=asyncio.Queue())
            if not dst:
                x.state = TransferState.DONE
                return
            chunks = self._streamed(request_id, transfer_id, x.parts)
            coro = self._push(endpoint.grpc.address, transfer_id, chunks, x)
            x.future = asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _push_blocks(self, transfer_id: str, src: list[int]) -> None:
        with self._lock:
            x = self._xfers[transfer_id]
            if x.dst is None:
                raise ValueError(f"transfer {transfer_id!r} was not begun")
            if len(src) > len(x.dst) - x.pushed:
                raise ValueError(f"{len(src)} blocks pushed, {len(x.dst) - x.pushed} left")
            if x.state.finished or not src:
                return
            dst, x.pushed = x.dst[x.pushed:x.pushed + len(src)], x.pushed + len(src)
            self._loop.call_soon_threadsafe(x.parts.put_nowait, (src, dst))
            if x.pushed == len(x.dst):
                self._loop.call_soon_threadsafe(x.parts.put_nowait, None)

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            x = self._xfers.get(transfer_id)
            if x is not None and not x.state.finished and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._cancel_on_loop, x)

    def _cancel_on_loop(self, x: _Push) -> None:
        x.cancelled = True  # a task not yet running sees it first thing and ends
        if x.task is not None:
            x.task.cancel()

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

    async def _streamed(self, request_id: str, tid: str,
                        parts: asyncio.Queue) -> AsyncIterator[transfer_pb2.KVChunk]:
        """The KVChunks of a streamed transfer, packed as its parts are pushed."""
        first = True
        while (part := await parts.get()) is not None:
            for chunk in self._chunks(request_id, tid, *part, first):
                yield chunk
            first = False

    def _chunks(self, request_id: str, tid: str, src: list[int], dst: list[int],
                first_of_stream: bool) -> Iterator[transfer_pb2.KVChunk]:
        """KVChunks of whole blocks (or slices of one block when a block exceeds a chunk);
        the stream's first chunk carries the layout hash and block size."""
        first = {"layout_hash": self.layout_hash, "block_bytes": self.block_bytes} \
            if first_of_stream else {}
        return pack_chunks(self.kv_cache, self.block_bytes, self.chunk_bytes, src, dst,
                           first=first, every={"request_id": request_id, "transfer_id": tid})

    def _start_pull(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        pid = pull_id(transfer_id)
        with self._lock:
            if self._loop.is_closed():
                raise RuntimeError("GrpcSender is closed")
            if pid in self._xfers:
                raise ValueError(f"transfer {pid!r} is already live")
            x = self._xfers[pid] = _Push(deadline)
            if not src:
                x.state = TransferState.DONE
                return
            req = transfer_pb2.PullRequest(request_id=request_id, transfer_id=transfer_id,
                                           layout_hash=self.layout_hash,
                                           block_bytes=self.block_bytes, src_block_ids=src)
            coro = self._pull(endpoint.grpc.address, req, dict(zip(src, dst)), x)
            x.future = asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _pull(self, address: str, req: transfer_pb2.PullRequest, into: dict[int, int],
                    x: _Push) -> None:
        """Read the blocks `req` names into the local blocks `into` maps them to."""
        state, left = TransferState.FAILED, dict.fromkeys(into.values(), self.block_bytes)
        try:
            x.task = asyncio.current_task()
            if x.cancelled:
                raise asyncio.CancelledError
            timeout = max(0.0, x.deadline - time.monotonic())
            async for chunk in self._stub(address).PullBlocks(req, timeout=timeout):
                if not write_chunk(self.kv_cache, self.block_bytes, chunk, into, left):
                    raise ValueError(f"pull {req.transfer_id}: chunk does not fit what is left")
            if not left and self.kv_cache.is_cuda:  # DONE once the copies have landed
                torch.cuda.synchronize(self.kv_cache.device)
            state = TransferState.DONE if not left else TransferState.FAILED
        except asyncio.CancelledError:
            state = TransferState.CANCELLED
            raise
        except grpc.aio.AioRpcError as e:
            log.warning("KV pull %s from %s failed: %s %s", req.transfer_id, address,
                        e.code().name, e.details())
        except Exception:
            log.exception("KV pull %s from %s failed", req.transfer_id, address)
        finally:
            with self._lock:
                if not x.state.finished:
                    x.state = state

    async def _push(self, address: str, tid: str, chunks: AsyncIterator[transfer_pb2.KVChunk],
                    x: _Push) -> None:
        state = TransferState.FAILED
        try:
            x.task = asyncio.current_task()
            if x.cancelled:
                raise asyncio.CancelledError
            timeout = max(0.0, x.deadline - time.monotonic())
            ack = await self._stub(address).PushBlocks(chunks, timeout=timeout)
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
