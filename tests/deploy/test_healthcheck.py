"""`python -m baton.worker.healthcheck`: the probe docker-compose.yml runs in every container."""
from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.worker.healthcheck import main


@pytest.fixture
def grpc_health():
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_grpc_serving_and_not(grpc_health):
    address, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main([address, "--quiet"]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([address, "--quiet"]) == 1
    servicer.set("baton.DecodeService", health_pb2.HealthCheckResponse.SERVING)
    assert main([address, "--service", "baton.DecodeService", "--quiet"]) == 0
    assert main([address, "--service", "nosuch", "--quiet"]) == 1  # NOT_FOUND


def test_grpc_nothing_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main([f"127.0.0.1:{port}", "--timeout", "1", "--quiet"]) == 1


@pytest.mark.parametrize("status,expected", [(200, 0), (503, 1)])
def test_http(status, expected):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/health"
        assert main(["--http", url, "--quiet"]) == expected
    finally:
        httpd.shutdown()


def test_command_line_is_light_and_exits_with_status(grpc_health):
    """As a container runs it: a process of its own, no torch import, exit code = verdict."""
    address, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    code = ("import runpy, sys; sys.argv = ['x', sys.argv[1]]\n"
            "try:\n    runpy.run_module('baton.worker.healthcheck', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert 'torch' not in sys.modules, 'healthcheck imported torch'\n"
            "    raise")
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SERVING" in out.stdout
    out = subprocess.run([sys.executable, "-m", "baton.worker.healthcheck"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "one of them" in out.stderr
