"""A real Mooncake master for the KV store tests (a pytest fixture in test modules that
use it): 127.0.0.1, a free port, torn down after. Skips, naming the missing library, when
`mooncake.store` does not import."""
from __future__ import annotations

import pytest

from baton.cluster.kv_master import start_master, stop_master
from baton.engine.store_client import import_error


def need_mooncake() -> None:
    """Skip the test when the Mooncake Store client cannot be used here."""
    err = import_error()
    if err is not None:
        pytest.skip(err)


def master(tmp_path_factory):
    """Yield the URL of a fresh master (a generator for a fixture); kills it after."""
    need_mooncake()
    child, url = start_master(tmp_path_factory.mktemp("mooncake") / "master.log")
    try:
        yield url
    finally:
        stop_master(child)
