"""The packaged install works: the wheel `pip install .` builds, installed into a fresh
virtual environment outside the checkout, starts `baton up` and serves a chat request
through the official `openai` client (a wheel without the native kernels' sources once
crashed every worker at model load)."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import openai
import pytest

from tests.test_cluster_e2e import REPO, baton_up

pytestmark = pytest.mark.slow


def _build_wheel(out: Path) -> Path:
    """The wheel of this checkout's files (tracked or not ignored; built from a copy:
    setuptools writes its build folders into the source tree)."""
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((REPO / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out / "dist"), str(src)], check=True, timeout=300)
    return next((out / "dist").glob("baton-*.whl"))


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed (no dependencies: those come from this test's
    environment through a .pth path entry, which does not run that environment's .pth
    files, so this checkout's editable install stays invisible). Returns its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    py = root / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "baton-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --ignore-installed: the dependencies' path also holds this checkout's editable install
    # (same name and version), which pip would otherwise take as already satisfying the wheel
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", str(wheel)], check=True, timeout=300)
    return root / "bin"


def test_the_wheel_serves_from_a_fresh_venv(tmp_path):
    wheel = _build_wheel(tmp_path / "build")
    bin_dir = _fresh_venv(tmp_path / "venv", wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import baton, kernels.gemv as g; "
         "print(baton.__file__); print(g._HASHED[0]); print(g.gemv_available())"],
        cwd=tmp_path, env=env, check=False, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-3000:]
    where = where.stdout.split()
    assert all(str(tmp_path / "venv") in w for w in where[:2]), where  # not the checkout
    assert Path(where[1]).is_file() and where[2] == "True"  # csrc shipped, kernels built
    with baton_up("smollm2-135m", "--kv-host-tier-fraction", "0", cwd=tmp_path, env=env,
                  command=(str(bin_dir / "baton"),)) as (url, _proc):
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           timeout=120) as client:
            assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
            out = client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "Hello!"}],
                max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens > 0
