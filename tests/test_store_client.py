"""MooncakeClient's breaker and connection epochs without a master (a stand-in library store
and a scripted TCP probe): a master that went away and answers again is reconnected at the
next check, one that kept answering while calls failed only after `retry_s`; a master that
lost this client's sentinel (restarted) starts a new epoch. Each new epoch after the first
is counted in `reconnects`."""
from __future__ import annotations

from baton.engine.store_client import RPC_FAIL, MooncakeClient


class FakeStore:
    """The library store's calls the client makes: a dict, or RPC_FAIL when `failing`."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.failing = False

    def put_parts(self, key, *parts) -> int:
        if self.failing:
            return RPC_FAIL
        self.values[key] = b"".join(parts)
        return 0

    def is_exist(self, key) -> int:
        return RPC_FAIL if self.failing else int(key in self.values)


def _client(monkeypatch) -> tuple[MooncakeClient, FakeStore, list[bool]]:
    """A client already set up on a FakeStore; append to the list to script the probe."""
    c = MooncakeClient("mooncake://127.0.0.1:1", local_host="127.0.0.1", retry_s=3600.0)
    store, reachable = FakeStore(), [True]
    monkeypatch.setattr(c, "_reachable", lambda: reachable[-1])

    def connect() -> None:
        c._store, c._down = store, False
        c._new_epoch("connected")
    monkeypatch.setattr(c, "_connect", connect)
    c.check()
    assert c.connected and c.epoch == 1 and c.reconnects == 0
    return c, store, reachable


def test_the_sentinel_is_put_then_checked(monkeypatch):
    c, store, _ = _client(monkeypatch)
    assert store.values == {c._sentinel: b"1"}
    c.check()
    assert c.epoch == 1 and c.connected


def test_a_master_that_lost_the_sentinel_is_a_new_epoch(monkeypatch):
    c, store, _ = _client(monkeypatch)
    store.values.clear()  # restarted between two checks, no call failed meanwhile
    c.check()
    assert c.epoch == 2 and c.reconnects == 1 and c.connected
    assert c._sentinel in store.values  # put again for the new master


def test_a_master_that_went_away_is_used_again_at_the_next_check(monkeypatch):
    c, store, reachable = _client(monkeypatch)
    store.failing = True
    c.check()  # the sentinel call fails: the breaker opens for retry_s (an hour here)
    assert not c.connected
    store.failing = False
    c.check()
    assert not c.connected  # it kept answering: a flaky master waits out retry_s
    reachable.append(False)
    c.check()  # refused: it went away...
    reachable.append(True)
    c.check()  # ...and answers again: a restarted master, reconnected at once
    assert c.connected and c.epoch == 2 and c.reconnects == 1
    assert c.unavailable >= 1


def test_a_restarted_master_that_refuses_puts_is_no_epoch_yet(monkeypatch):
    """A restarted master refuses puts until the library mounts this client's segment
    again (about a second): the client is not `connected` and the epoch does not advance
    until the sentinel is stored, so the store tier publishes nothing it would lose."""
    c, store, _ = _client(monkeypatch)
    store.values.clear()  # restarted...
    refused = [True]
    put = store.put_parts
    monkeypatch.setattr(store, "put_parts",
                        lambda key, *parts: -200 if refused[-1] else put(key, *parts))
    c.check()  # ...and the segment is not mounted yet
    assert c.epoch == 1 and c.reconnects == 0 and not c.connected
    c.check()
    assert not c.connected
    refused.append(False)  # mounted again
    c.check()
    assert c.epoch == 2 and c.reconnects == 1 and c.connected
    assert c._sentinel in store.values
