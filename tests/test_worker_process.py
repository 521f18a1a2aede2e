"""The process contract every role shares (baton/worker/process.py): the READY line as
written and as read back, and the exit status of a start that failed; and the one set of
gRPC options (baton/grpc_options.py) with the gateway's derived keepalive."""
from __future__ import annotations

import asyncio
import os
import signal

from baton.grpc_options import CHANNEL_OPTIONS, with_options
from baton.worker.process import Ready, StartFailed, announce, parse_ready, serve_until_signalled


def test_ready_line_round_trips(capsys):
    for ready in (Ready(5), Ready(50051, 9100)):
        announce(ready)
        assert parse_ready(capsys.readouterr().out) == ready
    assert Ready(7).line() == "READY port=7"
    assert Ready(7, 8).line() == "READY port=7 metrics_port=8"
    for other in ("", "[gateway] serving x on http://127.0.0.1:1", "NOT READY port=1",
                  "READY port=x", '{"msg": "READY port=1"}'):
        assert parse_ready(other) is None


def test_failed_start_exits_1_and_a_served_one_stops():
    async def fail():
        raise StartFailed

    class Served:
        port, metrics_port, stopped = 3, None, False

        async def stop(self):
            Served.stopped = True

    async def started():  # the stop signals are handled by now: SIGTERM ends the serving
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        return Served()

    assert asyncio.run(serve_until_signalled(fail)) == 1
    assert asyncio.run(serve_until_signalled(started)) == 0 and Served.stopped


def test_gateway_options_derive_from_the_shared_ones():
    from gateway.workers import CHANNEL_OPTIONS as GATEWAY

    gateway, shared = dict(GATEWAY), dict(CHANNEL_OPTIONS)
    assert gateway["grpc.keepalive_time_ms"] == 10_000
    assert gateway["grpc.keepalive_permit_without_calls"] == 1
    assert {k: v for k, v in gateway.items() if "keepalive" not in k} == \
        {k: v for k, v in shared.items() if "keepalive" not in k}
    assert dict(with_options(CHANNEL_OPTIONS, max_send_message_length=1))[
        "grpc.max_send_message_length"] == 1
