"""KV-cache block transfer from prefill to decode workers, behind one small interface.

    receiver = make_receiver("nixl" | "grpc" | "inproc", kv_cache, layout)   # decode side
    sender = make_sender("nixl" | "grpc" | "inproc", kv_cache, layout)       # prefill side

See base.py for the interface and the hand-over, layout.py for the compatibility hash, and
nixl.py + nixl_sender.py / grpc.py + grpc_sender.py / inproc.py for the transports (receiver
and sender of each; inproc is for unit tests only). Transport
modules are imported lazily: NIXL is heavy and absent from some deployments.
"""
from __future__ import annotations

import torch

from baton.transfer.base import DEFAULT_TIMEOUT_S, KVReceiver, KVSender, TransferState, pull_id
from baton.transfer.layout import (
    KV_PROTOCOL_VERSION,
    KVLayoutError,
    block_bytes,
    check_compatible,
    kv_layout,
    kv_layout_hash,
)
from protos import common_pb2, prefill_pb2

KINDS = ("nixl", "grpc", "inproc")
# For HandshakeRequest/Response.transports.
TRANSPORT_KINDS = {
    "nixl": prefill_pb2.TRANSPORT_KIND_NIXL,
    "grpc": prefill_pb2.TRANSPORT_KIND_GRPC,
    "inproc": prefill_pb2.TRANSPORT_KIND_INPROC,
}


def make_receiver(kind: str, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, *,
                  name: str | None = None, address: str | None = None) -> KVReceiver:
    """Decode-side receiver owning the registration of `kv_cache`.

    name: NIXL agent name or inproc registry name (generated when None); address: host:port of
    the decode server for "grpc" (or set later with set_address; then call add_to_server).
    Raises KVLayoutError when kv_cache does not match layout, ValueError for an unknown kind.
    """
    if kind == "nixl":
        from baton.transfer.nixl import NixlReceiver
        return NixlReceiver(kv_cache, layout, name=name)
    if kind == "grpc":
        from baton.transfer.grpc import GrpcReceiver
        return GrpcReceiver(kv_cache, layout, address=address)
    if kind == "inproc":
        from baton.transfer.inproc import InprocReceiver
        return InprocReceiver(kv_cache, layout, name=name)
    raise ValueError(f"unknown KV transport {kind!r}; expected one of {KINDS}")


def make_sender(kind: str, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, *,
                name: str | None = None) -> KVSender:
    """Prefill-side sender registering `kv_cache`; name: NIXL agent name (generated when None).

    Raises KVLayoutError when kv_cache does not match layout, ValueError for an unknown kind.
    """
    if kind == "nixl":
        from baton.transfer.nixl_sender import NixlSender
        return NixlSender(kv_cache, layout, name=name)
    if kind == "grpc":
        from baton.transfer.grpc_sender import GrpcSender
        return GrpcSender(kv_cache, layout)
    if kind == "inproc":
        from baton.transfer.inproc import InprocSender
        return InprocSender(kv_cache, layout)
    raise ValueError(f"unknown KV transport {kind!r}; expected one of {KINDS}")


__all__ = [
    "DEFAULT_TIMEOUT_S", "KINDS", "KVLayoutError", "KVReceiver", "KVSender", "KV_PROTOCOL_VERSION",
    "TRANSPORT_KINDS", "TransferState", "block_bytes", "check_compatible", "kv_layout", "kv_layout_hash",
    "make_receiver", "make_sender", "pull_id",
]
