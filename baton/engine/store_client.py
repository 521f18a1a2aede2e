"""A Mooncake Store client for the KV store tier (kv_store.py): one object per worker, with a
breaker so a store that is down costs one slow call, not one per block.

    mooncake://HOST:PORT    the master's RPC address (mooncake_master --rpc_port=PORT)

Metadata goes peer to peer (`P2PHANDSHAKE`: no etcd, no HTTP metadata server): each client
listens on its own address (`local_host`, default the address this host uses toward the
master) and the master tells readers where an object lives. A client lends
`segment_bytes` of its memory to the store (the master places objects in the segments of
all clients; it evicts when they are full) and registers `buffer_bytes` for its transfers.

States: down (not set up yet) → connected → (a call fails, or the master stops accepting TCP
connections) → down; `check()`, on the store tier's writer thread about once a second, sets
up and closes the breaker again once the master accepts connections (tried every
`retry_s`). While down every call answers "unavailable" at once; `unavailable` counts
those answers plus the failures.

A restarted master knows nothing: no object, no segment (the library mounts this client's
segment again by itself within about a second, its first puts meanwhile refused). Each
connection therefore puts a small sentinel value under a key of its own, and `check()` asks
for it while connected: gone means the master is not the one this client knew (it
restarted, or evicted the sentinel under pressure: either way what this client believed
stored may not be). Both that and a breaker closing again after an outage start a new
`epoch` (counted in `reconnects`): the store tier then forgets which blocks it believed
stored (kv_store.py) and publishes them again. An epoch begins only once its sentinel is
stored: until then the client is not `connected`, so nothing is published into a master
that would refuse it.
Library: PyPI `mooncake-transfer-engine-non-cuda` (module `mooncake.store`); it needs
Debian's libibverbs1 and librdmacm1 even for TCP.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from urllib.parse import urlparse

log = logging.getLogger(__name__)

SCHEME = "mooncake"
RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer


class StoreUnavailable(RuntimeError):
    """The store cannot be used now (library missing, master unreachable, call failed)."""


def import_error() -> str | None:
    """None when `mooncake.store` imports, else why not (a missing library is named)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:  # OSError of a missing libibverbs arrives as ImportError
        return f"mooncake.store does not import ({e}); pip install -r requirements.txt " \
               "and apt-get install libibverbs1 librdmacm1"
    return None


def parse_store_url(url: str) -> tuple[str, int]:
    """(host, port) of `mooncake://HOST:PORT`. Raises ValueError for anything else."""
    u = urlparse(url)
    if u.scheme != SCHEME or not u.hostname or not u.port or u.path not in ("", "/"):
        raise ValueError(f"KV store URL must be mooncake://HOST:PORT, got {url!r}")
    return u.hostname, u.port


def local_address_toward(host: str, port: int) -> str:
    """The IP this host uses to reach host:port (a UDP connect sends nothing); 127.0.0.1
    for a loopback master."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class MooncakeClient:
    """Thread-safe get/put/exists on one Mooncake master with the breaker of the module
    docstring. Keys are str, values bytes. No call raises for a store that is down:
    `get`/`exists` answer a miss and `put` puts nothing, each counted in `unavailable`.
    Set-up and the breaker are `check()`'s, called by one background thread (the store
    tier's writer), so a worker starts without waiting for the store. Raises ValueError
    for a bad URL.
    """

    def __init__(self, url: str, segment_bytes: int = 128 << 20, buffer_bytes: int = 32 << 20,
                 local_host: str | None = None, retry_s: float = 5.0) -> None:
        self.url = url
        self.host, self.port = parse_store_url(url)
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.local_host = local_host or local_address_toward(self.host, self.port)
        self.retry_s = retry_s
        self.unavailable = 0
        self.refused = 0  # puts the store refused (full), breaker untouched
        self.epoch = 0  # the master connection's generation (module docstring); 0: none yet
        self.reconnects = 0  # epochs after the first: outages ended, master restarts seen
        self._sentinel = f"baton-kv/alive/{uuid.uuid4().hex}"
        self._sentinel_put = False  # stored under this epoch (else: put it at the next check)
        self._epoch_why = ""  # why the epoch being started began (logged once it starts)
        self._store = None
        self._down = True  # until set up; then while the breaker is open
        self._gone = False  # the master refused connections since the breaker opened
        self._retry_at = 0.0
        self._closed = False
        self._up = threading.Event()  # set once set-up succeeded

    @property
    def connected(self) -> bool:
        """Set up, the breaker closed, and this epoch's sentinel stored (so the master has
        this client's segment mounted: a put now is not refused for want of one)."""
        return self._store is not None and not self._down and self._sentinel_put

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the first epoch began (set up, sentinel stored: tests, benchmarks);
        False on timeout."""
        return self._up.wait(timeout_s)

    def _reachable(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def check(self) -> None:
        """The breaker's clock (one background thread calls it about once a second): set up
        when not yet, close the breaker once the master answers again, open it when the
        master stops answering. A TCP connect to the master decides first: the library's
        calls hold the GIL, and against a dead master they take seconds (set-up ~90 s).
        While the breaker is open that connect is tried every check: a master that went
        away (refused) and answers again is a restarted one, used at once; one that kept
        answering while calls failed is retried only every `retry_s`."""
        if self._closed:
            return
        now = time.monotonic()
        if not self._reachable():
            self._gone = True
            if not self._down or now >= self._retry_at:
                self._trip("master not reachable")
            return
        if self._down and now < self._retry_at and not self._gone:
            return
        self._gone = False
        if self._store is None:
            self._connect()
        elif self._down:
            self._down = False
            self._new_epoch("the master answers again")
        else:
            self._verify()

    def _new_epoch(self, why: str) -> None:
        """A new master connection: the epoch begins once its sentinel is stored (_verify)."""
        self._sentinel_put = False
        self._epoch_why = why
        self._verify()

    def _verify(self) -> None:
        """Connected: put the sentinel once per epoch, then check it is still there (gone:
        another master, a new epoch). Until the put succeeds the client is not `connected`
        and the epoch does not advance: a restarted master refuses puts for about a second,
        until the library has mounted this client's segment again, and blocks published
        then would be dropped, not written (the CI failure of stop 34)."""
        store = self._store
        if not self._sentinel_put:
            rc = store.put_parts(self._sentinel, b"1")
            if rc == RPC_FAIL:
                self._trip(f"put returned {rc}")
            if rc != 0:
                return  # refused: the segment is not mounted again yet; next check
            self._sentinel_put = True
            self.epoch += 1
            self._up.set()
            if self.epoch > 1:
                self.reconnects += 1
                log.warning("KV store %s: %s; blocks believed stored are published again",
                            self.url, self._epoch_why)
            return
        code = store.is_exist(self._sentinel)
        if code < 0:
            self._trip(f"is_exist returned {code}")
        elif code == 0:
            self._new_epoch("the master lost what it held (restarted)")

    def _connect(self) -> None:
        err = import_error()
        if err is not None:
            self._trip(err)
            return
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(self.local_host, "P2PHANDSHAKE", self.segment_bytes, self.buffer_bytes,
                         "tcp", "", f"{self.host}:{self.port}")
        if rc != 0:
            self._trip(f"setup returned {rc}")
            return
        if self._closed:
            store.close()
            return
        self._store, self._down = store, False
        log.info("KV store %s connected (segment %d B, local %s)", self.url, self.segment_bytes,
                 self.local_host)
        self._new_epoch("connected")

    def _trip(self, why: str) -> None:
        if not self._down or not self.unavailable:
            log.warning("KV store %s unavailable (%s); retrying every %.0f s, serving "
                        "without it", self.url, why, self.retry_s)
        self._down = True
        self._retry_at = time.monotonic() + self.retry_s
        self.unavailable += 1

    def _ready(self):
        """The library store object, or None (counted) while not set up or down."""
        store = self._store
        if store is None or self._down:
            self.unavailable += 1
            return None
        return store

    def exists_many(self, keys: Sequence[str]) -> list[bool] | None:
        """Membership of each key; None when the store is unavailable."""
        store = self._ready()
        if store is None:
            return None
        codes = store.batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            self._trip(f"batch_is_exist returned {min(codes)}")
            return None
        return [c == 1 for c in codes]

    def get(self, key: str) -> bytes | None:
        """The value of `key`; None for a miss or an unavailable store."""
        store = self._ready()
        if store is None:
            return None
        code = store.is_exist(key)
        if code < 0:
            self._trip(f"is_exist returned {code}")
            return None
        if code == 0:
            return None
        value = store.get(key)
        return value or None  # b"": evicted since, or the call failed (next one tells)

    def put(self, key: str, *parts) -> bool:
        """Store one value made of buffer `parts` (concatenated); False when it failed.
        Only an RPC failure opens the breaker; a refused put (the store is full: Mooncake's
        NO_AVAILABLE_HANDLE, -200, while it evicts) fails alone, counted in `refused`."""
        store = self._ready()
        if store is None:
            return False
        rc = store.put_parts(key, *parts)
        if rc == RPC_FAIL:
            self._trip(f"put returned {rc}")
            return False
        if rc != 0:
            self.refused += 1
            return False
        return True

    def remove(self, key: str) -> None:
        """Delete `key` (best effort: a failure only leaves a value the reader drops)."""
        store = self._ready()
        if store is not None:
            store.remove(key, True)

    def abandon(self) -> None:
        """Stop using the client while another thread may still be in a call (a set-up
        that finishes later closes what it made)."""
        self._closed = True

    def close(self) -> None:
        """Unmount this client's segment and disconnect (its objects leave the store). Call
        once no other thread uses the client."""
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            store.close()
