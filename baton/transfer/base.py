"""The KV transfer interface: a decode-side receiver and a prefill-side sender.

    prefill (KVSender)                                   decode (KVReceiver)
                                                          ep = receiver.endpoint()
                                                          receiver.expect(tid, dst_ids)
    sender.send(ep, tid, src_ids, dst_ids)  ── blocks ──▶  kv_cache[dst_ids[i]] = src kv_cache[src_ids[i]]
  or, streamed (transports with `streams`):
    sender.begin(ep, tid, dst_ids); sender.push(tid, src_ids[:k]); ... push(tid, rest)
    sender.poll(tid) / wait(tid) -> DONE                  receiver.poll(tid) -> DONE
    sender.forget(tid)                                    receiver.forget(tid)

  and the other way, before a prefill computes (the blocks the decode worker holds of the
  prompt and the prefill worker lacks, read instead of recomputed):
                                                          receiver.expect(tid, dst_ids,
                                                                          src_block_ids=held)
    sender.pull(ep, tid + "/pull", held[i:j], own_ids)  ◀── blocks ──  (decode's kv_cache)
    sender.poll(tid + "/pull") -> DONE: own_ids hold decode's blocks held[i:j]

Each side owns one block-major kv_cache (see layout.py) and validates it against its KVLayout.
Transfers are named by a caller-chosen transfer_id (unique among a side's live transfers);
block i of src_block_ids lands in block i of dst_block_ids. A transfer of zero blocks is DONE
at once on both sides. Everything but send's argument checks reports failure through the
state (FAILED), never by raising or blocking: every wait is bounded.

Safety: NIXL writes are one-sided, so a NIXL sender turns FAILED or CANCELLED only after NIXL
released the request (no write follows); gRPC writes happen on the receiver, which writes
nothing for a transfer after forget(). The decode side may therefore reuse a transfer's
blocks once its own state is DONE, or once it forgot the transfer and the prefill side
reported a final state (or its lease ended); never merely because expect()'s timeout passed.
The same holds for the blocks a pull reads (a NIXL READ is one-sided too; gRPC serves reads
of a transfer only while it is expected): until then they must not change.

Threading: every method may be called from any thread; each object serializes its own state
behind one lock (transports may add one background thread). poll() never blocks on I/O;
wait() blocks its caller; async code uses wait_async().
"""
from __future__ import annotations

import abc
import asyncio
import enum
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.transfer.layout import KVLayoutError, block_bytes, check_kv_cache, kv_layout_hash
from protos import common_pb2, transfer_pb2

DEFAULT_TIMEOUT_S = 30.0


class TransferState(enum.IntEnum):
    """Life of one transfer; everything from DONE on is final."""

    PENDING = 0      # known, no byte has moved yet
    IN_PROGRESS = 1  # bytes are moving
    DONE = 2         # every byte is in place on the receiver
    FAILED = 3       # an error or the timeout: the destination blocks hold garbage
    CANCELLED = 4    # stopped by close() before it ended

    @property
    def finished(self) -> bool:
        return self >= TransferState.DONE


def pull_id(transfer_id: str) -> str:
    """The sender's name for the pull that reads the blocks `transfer_id` made readable."""
    return transfer_id + "/pull"


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> list[int]:
    """`ids` as a list of distinct ints in [0, num_blocks); ValueError otherwise."""
    out = [int(i) for i in ids]
    if any(i < 0 or i >= num_blocks for i in out):
        raise ValueError(f"{what} must lie in [0, {num_blocks}), got {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"{what} must be distinct, got {out}")
    return out


class _KVSide:
    """What both sides share: the validated kv_cache, its layout and a lock."""

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout) -> None:
        check_kv_cache(kv_cache, layout)
        self.kv_cache = kv_cache
        self.layout = layout
        self.layout_hash = kv_layout_hash(layout)
        self.block_bytes = block_bytes(layout)
        self.num_blocks = kv_cache.shape[0]
        self._lock = threading.Lock()


@dataclass
class _Expected:
    dst_block_ids: list[int]
    deadline: float  # time.monotonic() seconds; inf = none
    state: TransferState
    readable: frozenset[int] = frozenset()  # blocks a pull of this transfer may read


class KVReceiver(_KVSide, abc.ABC):
    """Decode side: registers the decode kv_cache and tells when expected blocks have landed.

    Subclasses implement endpoint() and close() and record arrivals in
    self._transfers[transfer_id].state with self._lock held; _progress() is their hook to
    collect transport news before a poll.

    refuses_late_writes: True when nothing a sender does after forget(transfer_id) can write
    into that transfer's blocks (the receiver does the writing and drops unknown transfers);
    False when writes are one-sided (NIXL), so a sender that did not confirm it stopped may
    still write into them. The default claims nothing.
    """

    refuses_late_writes: bool = False

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout) -> None:
        super().__init__(kv_cache, layout)
        self._transfers: dict[str, _Expected] = {}

    @abc.abstractmethod
    def endpoint(self) -> transfer_pb2.TransferEndpoint:
        """Where senders write into this receiver's kv_cache (send it in PrefillRequest)."""

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None,
               src_block_ids: Sequence[int] = ()) -> None:
        """Announce a transfer before the sender starts it (before the Prefill RPC goes out).

        timeout_s (seconds, None = no limit): poll() reports FAILED past it. With NIXL a
        late sender can still write afterwards, so keep the blocks until the Prefill RPC has
        answered (or its lease ended) before reusing them. src_block_ids: blocks the sender
        may read first (`KVSender.pull`), kept unchanged by the caller on the same terms.
        Raises ValueError for a live transfer_id or block ids outside the cache.
        """
        ids = check_block_ids(dst_block_ids, self.num_blocks, "dst_block_ids")
        readable = frozenset(check_block_ids(src_block_ids, self.num_blocks, "src_block_ids"))
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            state = TransferState.PENDING if ids else TransferState.DONE
            self._transfers[transfer_id] = _Expected(ids, deadline, state, readable)

    def readable(self, transfer_id: str, block_ids: Sequence[int]) -> bool:
        """Whether a live transfer made every one of `block_ids` readable (for transports
        that serve pulls themselves: gRPC, in-process)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            return t is not None and set(block_ids) <= t.readable

    def poll(self, transfer_id: str) -> TransferState:
        """Current state, without blocking. Raises KeyError for an unknown transfer_id."""
        with self._lock:
            self._progress()
            t = self._transfers[transfer_id]
            if not t.state.finished and time.monotonic() > t.deadline:
                t.state = TransferState.FAILED
            return t.state

    def forget(self, transfer_id: str) -> None:
        """Drop a transfer's bookkeeping (no-op if unknown). Chunks that still arrive for it
        are refused on gRPC; NIXL writes cannot be refused (see expect)."""
        with self._lock:
            self._transfers.pop(transfer_id, None)

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister the kv_cache and release the transport. Idempotent."""

    # -- for subclasses --------------------------------------------------------------------
    def _progress(self) -> None:
        """Collect transport news (called with self._lock held). Default: nothing to do."""

    def _endpoint(self, **transport) -> transfer_pb2.TransferEndpoint:
        return transfer_pb2.TransferEndpoint(
            layout_hash=self.layout_hash, block_bytes=self.block_bytes, num_blocks=self.num_blocks, **transport)


class KVSender(_KVSide, abc.ABC):
    """Prefill side: writes chosen blocks of its own kv_cache into a receiver's blocks.

    Subclasses set `transport` (the TransferEndpoint oneof name they accept) and implement
    _start, poll, forget and close.
    """

    transport: str
    streams: bool = False  # begin/push/cancel stream one transfer as its blocks get ready

    def send(self, endpoint: transfer_pb2.TransferEndpoint, transfer_id: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], *, request_id: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Start writing src blocks into the receiver's dst blocks; returns without waiting for
        the transfer (NIXL copies a small one, ≤ 4 MiB, before returning: about a millisecond).

        timeout_s bounds the whole transfer (seconds): past it poll() reports FAILED. Raises
        KVLayoutError when the endpoint's layout hash or block size is not ours, ValueError
        for a wrong endpoint kind, a live transfer_id, or bad block ids. Transport errors
        (receiver gone, connection refused) do not raise: the transfer ends FAILED.
        """
        self._check_endpoint(endpoint)
        src = check_block_ids(src_block_ids, self.num_blocks, "src_block_ids")
        dst = check_block_ids(dst_block_ids, endpoint.num_blocks, "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} src blocks for {len(dst)} dst blocks")
        self._start(endpoint, transfer_id, src, dst, request_id, time.monotonic() + timeout_s)

    def pull(self, endpoint: transfer_pb2.TransferEndpoint, transfer_id: str,
             src_block_ids: Sequence[int], dst_block_ids: Sequence[int], *,
             request_id: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Start reading the receiver's src blocks (ids in its kv_cache, made readable by its
        expect(transfer_id, ..., src_block_ids)) into this side's dst blocks; returns without
        waiting. The pull is then `pull_id(transfer_id)` here: poll() / wait() / cancel() /
        forget() work on it as on a send; DONE = every byte is in the dst blocks. Same
        checks as send().
        """
        self._check_endpoint(endpoint)
        src = check_block_ids(src_block_ids, endpoint.num_blocks, "src_block_ids")
        dst = check_block_ids(dst_block_ids, self.num_blocks, "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} src blocks for {len(dst)} dst blocks")
        self._start_pull(endpoint, transfer_id, src, dst, request_id,
                         time.monotonic() + timeout_s)

    def _start_pull(self, endpoint: transfer_pb2.TransferEndpoint, transfer_id: str,
                    src: list[int], dst: list[int], request_id: str, deadline: float) -> None:
        """Begin the pull, tracked as pull_id(transfer_id) (ids checked)."""
        raise NotImplementedError(f"{type(self).__name__} cannot pull")

    def begin(self, endpoint: transfer_pb2.TransferEndpoint, transfer_id: str,
              dst_block_ids: Sequence[int], *, request_id: str = "",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Open a streamed transfer into all of dst_block_ids whose source blocks come later,
        in order, through push() (prefill sends each chunk's full blocks while it computes
        the next; the receiver sees one transfer, DONE once every dst block landed).

        Same checks and timeout as send(); NotImplementedError when `streams` is False (the
        caller then sends once, at the end).
        """
        if not self.streams:
            raise NotImplementedError(f"{type(self).__name__} sends whole transfers only")
        self._check_endpoint(endpoint)
        dst = check_block_ids(dst_block_ids, endpoint.num_blocks, "dst_block_ids")
        self._begin(endpoint, transfer_id, dst, request_id, time.monotonic() + timeout_s)

    def push(self, transfer_id: str, src_block_ids: Sequence[int]) -> None:
        """Send the next len(src_block_ids) source blocks of a begun transfer into its next
        dst blocks; returns without waiting. The push that reaches the last dst block ends
        the stream. The src blocks must stay unchanged until the transfer's state is final.
        A push to a transfer already final is ignored. Raises KeyError for an unknown
        transfer_id, ValueError for bad ids or more blocks than the transfer has left."""
        src = check_block_ids(src_block_ids, self.num_blocks, "src_block_ids")
        self._push_blocks(transfer_id, src)

    def cancel(self, transfer_id: str) -> None:
        """Stop a begun transfer; poll() turns final (CANCELLED, or the state it reached
        first) once no more bytes can move. No-op for an unknown or final transfer."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def _begin(self, endpoint: transfer_pb2.TransferEndpoint, transfer_id: str,
               dst: list[int], request_id: str, deadline: float) -> None:
        raise NotImplementedError

    def _push_blocks(self, transfer_id: str, src: list[int]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def poll(self, transfer_id: str) -> TransferState:
        """Current state, without blocking. Raises KeyError for an unknown transfer_id."""

    def wait(self, transfer_id: str, timeout_s: float) -> TransferState:
        """Block up to timeout_s seconds for a final state; returns the state then (which is
        not final if timeout_s ran out first; the send timeout still ends it later)."""
        deadline, pause = time.monotonic() + timeout_s, 20e-6
        while not (state := self.poll(transfer_id)).finished and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
        return state

    async def wait_async(self, transfer_id: str, timeout_s: float) -> TransferState:
        """wait() for asyncio callers: yields to the loop between polls."""
        deadline, pause = time.monotonic() + timeout_s, 20e-6
        while not (state := self.poll(transfer_id)).finished and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5e-4)
        return state

    @abc.abstractmethod
    def forget(self, transfer_id: str) -> None:
        """Drop a transfer's bookkeeping (no-op if unknown). Meant for final states: a
        transfer still in flight is cancelled, but that completes in the background after
        forget returns, so wait for a final state first when writes must have stopped."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop in-flight transfers (they end CANCELLED) and release the transport. Idempotent."""

    @abc.abstractmethod
    def _start(self, endpoint: transfer_pb2.TransferEndpoint, transfer_id: str, src: list[int],
               dst: list[int], request_id: str, deadline: float) -> None:
        """Begin the transfer (ids checked; deadline in time.monotonic() seconds)."""

    def _check_endpoint(self, endpoint: transfer_pb2.TransferEndpoint) -> None:
        if endpoint.layout_hash != self.layout_hash:
            raise KVLayoutError(
                f"receiver KV layout hash {endpoint.layout_hash:016x} != sender's {self.layout_hash:016x}")
        if endpoint.block_bytes != self.block_bytes:
            raise KVLayoutError(f"receiver block of {endpoint.block_bytes} bytes != sender's {self.block_bytes}")
        kind = endpoint.WhichOneof("transport")
        if kind != self.transport:
            raise ValueError(f"{type(self).__name__} cannot send to a {kind!r} endpoint")
