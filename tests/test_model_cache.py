"""Converting a registered model into a shared cache: several processes at once (pods'
prepare-model initContainers on one ReadWriteMany volume, compose services) convert it once,
every one of them gets the complete folder, and a published folder is never removed or
replaced under a reader. The real conversion (~40 s) is swapped for a slow fake writer; the
processes are real, so the lock is tested across processes as it is used."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from baton.models import registry

REPO = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m"

# One `baton prepare-model`: resolve_model with the GGUF file and the writer faked. The
# writer appends a line to conversions.log per conversion and writes slowly, so the
# processes overlap; LOCK=0 turns the lock off (a filesystem without locks).
CHILD = r"""
import contextlib, json, os, sys, time
from pathlib import Path
from baton.models import registry

cache = Path(sys.argv[1])

def fake_write(gguf, out):
    with open(cache / "conversions.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    (out / "tokenizer.json").write_text("{}")
    time.sleep(1.0)
    (out / "model.safetensors").write_bytes(b"x" * 1000)
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

@contextlib.contextmanager
def no_lock(path, name):
    yield False

registry._write_converted = fake_write
registry._gguf_path = lambda spec: Path("/nonexistent/model.gguf")
if os.environ.get("LOCK") == "0":
    registry._cache_lock = no_lock
print(registry.resolve_model("smollm2-135m", cache))
"""


def convert_at_once(cache: Path, n: int, lock: bool = True) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOCK": "1" if lock else "0"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def conversions(cache: Path) -> int:
    log = cache / "conversions.log"
    return len(log.read_text().split()) if log.exists() else 0


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if p.is_dir() and p.name != NAME)


def watch_never_partial(dest: Path, stop: threading.Event, seen: list[str]) -> None:
    """Whenever the published folder exists it is complete (a reader could load it)."""
    while not stop.is_set():
        if dest.exists() and not (dest / "config.json").is_file():
            seen.append("partial")
        time.sleep(0.002)


def test_concurrent_converters_convert_once(tmp_path):
    runs = convert_at_once(tmp_path, 4)
    dest = tmp_path / "models" / NAME
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(dest)
    assert conversions(tmp_path) == 1
    assert any("waiting for another process" in r.stderr for r in runs)
    assert leftovers(tmp_path) == []
    assert oct(dest.stat().st_mode & 0o777) == oct(0o755)


def test_without_a_lock_the_first_published_folder_stays(tmp_path):
    """Every process converts (no lock), each publishes by an atomic rename: the first one's
    folder stays in place, the others discard theirs, nobody fails or sees a partial one."""
    dest = tmp_path / "models" / NAME
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_never_partial, args=(dest, stop, seen))
    watcher.start()
    try:
        runs = convert_at_once(tmp_path, 4, lock=False)
    finally:
        stop.set()
        watcher.join()
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert conversions(tmp_path) == 4
    assert seen == []
    assert leftovers(tmp_path) == []


def test_a_complete_folder_is_never_replaced(tmp_path):
    dest = tmp_path / "models" / NAME
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    tmp = tmp_path / "models" / f".{NAME}-x"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    registry._publish(tmp, dest)
    assert json.loads((dest / "config.json").read_text())  # the first one, not ours


def test_an_incomplete_folder_is_replaced(tmp_path):
    """A folder without config.json (not written by this code) is moved aside atomically."""
    dest = tmp_path / "models" / NAME
    dest.mkdir(parents=True)
    (dest / "junk").write_text("half a model")
    runs = convert_at_once(tmp_path, 2)
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert (dest / "config.json").is_file() and not (dest / "junk").exists()
    assert leftovers(tmp_path) == []


def test_stale_conversion_folders_are_removed(tmp_path):
    models = tmp_path / "models"
    stale, fresh = models / f".{NAME}-dead", models / f".{NAME}-busy"
    for p in (stale, fresh):
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"x")
    old = time.time() - registry.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    registry._remove_stale(models, f".{NAME}-")
    assert not stale.exists() and fresh.exists()
