"""The serving roles and the module each one runs as (`python -m MODULE`), in one place for
`baton serve-*` (baton/cli.py) and `baton up` (baton/cluster/). Roles are separate processes,
so baton/ only ever names these modules, never imports them."""
from __future__ import annotations

# Role -> module. Tests point entries at stand-in processes (monkeypatch.setitem).
ROLE_MODULES = {"prefill": "prefill_service", "decode": "decode_service", "gateway": "gateway"}

# The environment variable the gateway reads its API key from (gateway/config.py): `baton up`
# hands the key over there, never on a command line (which `ps` shows to every user).
API_KEY_ENV = "BATON_API_KEY"
