"""vLLM's CPU build as a benchmark peer (baton/bench/vllm_server.py): its command line and
environment from the recipe, and `baton bench compare --configs vllm` starting it, with a
stand-in for vLLM (a fake server behind a fake venv's `python`) that records what it got."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from baton.bench.configs import spec_for
from baton.bench.local import ServerSpec
from baton.bench.vllm_server import VllmSpec, cpu_list
from baton.dtypes import resolve_dtype

STAND_IN = '''
import json, os, sys
sys.path.insert(0, {repo!r})
args = sys.argv[1:]
assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"], args
port = int(args[args.index("--port") + 1])
keep = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_AOT_COMPILE", "VLLM_HOST_IP", "HF_HUB_OFFLINE",
        "LD_PRELOAD")
with open({record!r}, "w") as f:
    json.dump({{"argv": args, "env": {{k: os.environ.get(k) for k in keep}}}}, f)
import uvicorn
from tests.bench.fake_server import FakeServer
uvicorn.run(FakeServer(baton=False).app(), host="127.0.0.1", port=port, log_level="warning")
'''


def _fake_vllm_venv(tmp_path: Path) -> tuple[Path, Path]:
    """(venv/bin/python running the stand-in, the file it records its argv and env in); the
    venv holds a lib/libiomp5.so as vLLM's does."""
    venv, record = tmp_path / "venv", tmp_path / "vllm-call.json"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN.format(repo=str(Path(__file__).resolve().parents[2]),
                                      record=str(record)))
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python, record


@pytest.mark.parametrize("cpus, want", [([0, 1], "0-1"), ([3], "3"), ([0, 1, 2, 5], "0-2,5"),
                                        ([6, 0, 2, 4, 5], "0,2,4-6")])
def test_cpu_list(cpus, want):
    assert cpu_list(cpus) == want


def test_argv_and_env_follow_the_recipe(tmp_path):
    python, _ = _fake_vllm_venv(tmp_path)
    spec = VllmSpec(str(python), "bfloat16", kv_cache_bytes=123, cpus=(0, 1))
    argv = spec.argv("/models/m", "smollm2-135m", 8001)
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::1], argv[4::1]))
    assert pairs["--model"] == "/models/m" and pairs["--served-model-name"] == "smollm2-135m"
    assert pairs["--dtype"] == "bfloat16" and pairs["--kv-cache-memory-bytes"] == "123"
    assert pairs["--port"] == "8001" and pairs["--host"] == "127.0.0.1"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
    env = spec.env({"PATH": "/bin", "LD_PRELOAD": "/x.so"})
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_USE_AOT_COMPILE"],
            env["VLLM_HOST_IP"], env["HF_HUB_OFFLINE"]) == ("0-1", "0", "127.0.0.1", "1")
    preload = env["LD_PRELOAD"].split(":")
    assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in preload and preload[-1] == "/x.so"
    assert env["PATH"] == "/bin"


def test_auto_dtype_is_the_machines_choice():
    assert VllmSpec("python").resolved_dtype == resolve_dtype("auto", "cpu")
    assert VllmSpec("python", "float32").resolved_dtype == "float32"


def test_vllm_config_serves_the_folder_baton_resolves(tiny_llama, tmp_path):
    python, _ = _fake_vllm_venv(tmp_path)
    spec = spec_for("vllm", vllm=VllmSpec(str(python), "float32"))
    assert spec.kind == "vllm" and spec.describe()["vllm"]["dtype"] == "float32"
    argv = spec.argv(str(tiny_llama), 9)
    assert argv[argv.index("--model") + 1] == str(tiny_llama)
    assert ServerSpec("b").env() is None and spec.env()["VLLM_HOST_IP"] == "127.0.0.1"


def test_compare_starts_vllm_and_compares_with_it(tiny_llama, tmp_path):
    from baton.bench.compare import main as compare_main
    from tests.bench.test_cli import FAST

    python, record = _fake_vllm_venv(tmp_path)
    out = tmp_path / "cmp"
    rc = compare_main(["--configs", "vllm", "--vllm-python", str(python), "--vllm-dtype",
                       "float32", "--vllm-kv-bytes", "4096", "--reference", "vllm",
                       "--model", str(tiny_llama), "--workload", "synthetic",
                       "--synthetic-sessions", "2", "--block-tokens", "16", "--concurrency",
                       "1", "--output", str(out), "--no-plots", "--startup-timeout", "60",
                       *FAST])
    assert rc == 0
    call = json.loads(record.read_text())
    assert call["argv"][call["argv"].index("--model") + 1] == str(tiny_llama)
    assert call["argv"][call["argv"].index("--kv-cache-memory-bytes") + 1] == "4096"
    assert call["env"]["VLLM_USE_AOT_COMPILE"] == "0" and "libiomp5.so" in call["env"]["LD_PRELOAD"]
    [row] = json.loads((out / "report.json").read_text())["rows"]
    assert row["name"] == "vllm" and row["reference"] is None
    assert row["server"]["vllm"]["dtype"] == "float32" and row["summary"]["errors"] == 0


def test_reference_overrides_each_rows_own():
    from baton.bench.configs import reference_of

    assert reference_of("disaggregated", None) == "colocated"
    assert reference_of("disaggregated", "vllm") == "vllm"
    assert reference_of("vllm", "vllm") is None
    assert reference_of("baton", None) is None
