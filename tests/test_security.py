"""Security basics (issue 7): every server listens on loopback unless told otherwise, and no
worker request can name a model or a file for the worker to load.

Covered elsewhere: the API key on every HTTP path but /health
(tests/gateway/test_http_api.py) and on the gRPC front (tests/gateway/test_grpc_front.py);
bounded HTTP bodies (tests/gateway/test_errors.py::test_body_too_large_413) and gRPC
messages (test_grpc_front.py); prompt lengths (gateway: "prompt over context" in
test_errors.py; workers: --max-prompt-tokens in tests/services/test_failures.py); a request
naming another model or a path is a 404 that never reaches a worker (test_errors.py).
"""
from __future__ import annotations

import dataclasses
import ipaddress

import psutil
import pytest

from baton.cluster.plan import prefill_args as up_worker_args
from baton.cluster.flags import parse_up_args
from baton.worker.flags import ServerConfig
from decode_service.config import parse_args as decode_args
from gateway.config import parse_args as gateway_args
from prefill_service.config import parse_args as prefill_args
from protos import decode_pb2, prefill_pb2
from decode_service.server import DecodeServer
from prefill_service.server import PrefillServer
from tests.services.helpers import decode_config, prefill_config


def test_every_server_defaults_to_loopback():
    assert ServerConfig().host == "127.0.0.1"
    assert prefill_args([]).server.host == "127.0.0.1"
    assert decode_args([]).server.host == "127.0.0.1"
    gw = gateway_args(["--decode", "127.0.0.1:50051"])
    assert gw.host == gw.grpc_host == "127.0.0.1"
    up = parse_up_args([])
    worker = up_worker_args(up)
    assert up.host == "127.0.0.1" and worker[worker.index("--host") + 1] == "127.0.0.1"


def _listening(before: set) -> list:
    return [c.laddr for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr not in before]


async def test_running_workers_listen_on_loopback_only(tiny_llama):
    """gRPC, KV transfer (NIXL) and metrics sockets of a live prefill + decode pair."""
    before = {c.laddr for c in psutil.Process().net_connections("inet")
              if c.status == psutil.CONN_LISTEN}
    server = ServerConfig(port=0, metrics_port=0)  # the host is left at its default
    prefill = await PrefillServer(dataclasses.replace(
        prefill_config(tiny_llama, "nixl"), server=server)).start()
    decode = await DecodeServer(dataclasses.replace(
        decode_config(tiny_llama, "nixl", prefill.address), server=server)).start()
    try:
        listening = _listening(before)
        ports = {a.port for a in listening}
        assert {prefill.port, decode.port, prefill.metrics_port, decode.metrics_port} <= ports
        for addr in listening:
            ip = ipaddress.ip_address(addr.ip)
            ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
            assert ip.is_loopback, listening
    finally:
        await decode.stop(drain_s=0)
        await prefill.stop(drain_s=0)


@pytest.mark.parametrize("message", [decode_pb2.GenerateRequest, prefill_pb2.PrefillRequest])
def test_worker_requests_name_no_model_or_file(message):
    """A worker serves the model it was started with: its requests carry token ids, never a
    model name, a folder or a file path it could be told to load."""
    def names(descriptor, seen=()):
        for f in descriptor.fields:
            yield f.name
            if f.message_type is not None and f.message_type not in seen:
                yield from names(f.message_type, (*seen, descriptor))

    suspicious = [n for n in names(message.DESCRIPTOR)
                  if any(w in n for w in ("model", "path", "file", "folder", "weights"))]
    assert not suspicious


def test_wildcard_bind_advertises_a_dialable_address():
    """A worker bound to 0.0.0.0 without --advertise-address must not tell peers to dial
    0.0.0.0; an explicit address wins; IPv6 literals are bracketed."""
    import ipaddress

    from baton.worker.start import advertised_address

    host, _, port = advertised_address("0.0.0.0", 5005).rpartition(":")
    assert port == "5005" and not ipaddress.ip_address(host).is_unspecified
    assert advertised_address("0.0.0.0", 5005, "decode-0:50051") == "decode-0:50051"
    assert advertised_address("::1", 7) == "[::1]:7"
    assert advertised_address("127.0.0.1", 7) == "127.0.0.1:7"
