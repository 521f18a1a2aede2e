"""Shared fixtures for the benchmark tests: the fake server and the shared trace copies."""
from pathlib import Path

import pytest

from tests.bench.fake_server import FakeServer, ServerThread

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"


@pytest.fixture
def traces() -> Path:
    if not TRACES.is_dir():
        pytest.skip(f"shared traces not found at {TRACES}")
    return TRACES


@pytest.fixture
def fake():
    """(FakeServer, base URL) running in a background thread."""
    server = FakeServer()
    with ServerThread(server.app()) as url:
        yield server, url
