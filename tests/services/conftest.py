"""Fixtures for the service tests: a tiny model, in-process server pairs per transport, and a
per-test Cluster (servers with configs of their own)."""
from __future__ import annotations

import pytest
import pytest_asyncio

from tests.services.helpers import FORCE_REMOTE, Cluster, pools_whole, start_pair, stop_pair

TRANSPORTS = ["nixl", "grpc"]


@pytest.fixture(scope="session")
def model(tiny_llama):
    return tiny_llama


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=TRANSPORTS)
async def pair(request, model):
    """(prefill server, decode server, client) sharing one transport, for a whole module;
    prompts of 16 uncached tokens or more are prefilled remotely (FORCE_REMOTE: these tests
    exercise that path). Tests leave both pools whole (checked after each test by `whole`)."""
    pair = await start_pair(model, request.param, **FORCE_REMOTE)
    yield pair
    await stop_pair(*pair)


@pytest_asyncio.fixture(loop_scope="module")
async def whole(pair):
    """The pair, checked afterwards: both pools whole, nothing held, nothing in flight."""
    yield pair
    prefill, decode, _ = pair
    await pools_whole(prefill, decode)
    assert not prefill.worker.entries and not decode.worker.jobs


@pytest.fixture
async def cluster():
    """A Cluster for one test: its servers and clients are closed afterwards."""
    c = Cluster()
    yield c
    await c.close()
