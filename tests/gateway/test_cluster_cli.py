"""`baton up` failure paths, fast: stand-in role processes instead of real workers."""
from __future__ import annotations

import time

from baton import cluster


def test_bad_arguments_and_unknown_model(capsys, tmp_path):
    assert cluster.main(["--num-decode", "0"]) == 2
    assert cluster.main(["--model", str(tmp_path / "missing")]) == 1
    assert "unknown model" in capsys.readouterr().err


def test_child_dying_during_startup_fails_clearly(monkeypatch, capsys, tiny_llama, tmp_path):
    monkeypatch.setitem(cluster.ROLE_MODULES, "prefill", "tests.gateway.fake_role")
    monkeypatch.setitem(cluster.ROLE_MODULES, "decode", "tests.gateway.fake_role")
    monkeypatch.setenv("FAKE_ROLE_EXIT", "3")
    start = time.monotonic()
    code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                         "--startup-timeout", "30"])
    assert code == 1 and time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "exited with status 3 during start-up" in err
    assert "fake role failing on purpose" in err  # the tail of its log


def test_gateway_that_never_gets_healthy_times_out(monkeypatch, capsys, tiny_llama, tmp_path):
    for role in ("prefill", "decode", "gateway"):
        monkeypatch.setitem(cluster.ROLE_MODULES, role, "tests.gateway.fake_role")
    monkeypatch.delenv("FAKE_ROLE_EXIT", raising=False)
    code = cluster.main(["--model", str(tiny_llama), "--log-dir", str(tmp_path),
                         "--startup-timeout", "2", "--port", "9"])
    assert code == 1
    assert "did not report every worker healthy within 2 s" in capsys.readouterr().err
