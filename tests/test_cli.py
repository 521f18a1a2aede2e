"""The `baton` command's own surface: version, unknown commands, thread defaults, and
`baton generate` on a tiny model with a pool sized to the request."""
import subprocess
import sys

from baton import __version__
from baton.cli import main
from baton.threads import default_num_threads


def test_version_and_unknown_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"baton {__version__}"
    assert main(["serve-decodee"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'serve-decodee'" in err and "serve-decode" in err


def test_threads_follow_omp_num_threads_else_the_free_cpus(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr("os.getloadavg", lambda: (2.6, 0.0, 0.0))
    assert default_num_threads() == 2
    monkeypatch.setattr("os.getloadavg", lambda: (9.0, 0.0, 0.0))
    assert default_num_threads() == 1


def test_generate_runs_on_a_tiny_model_with_a_pool_for_just_that(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "baton.cli", "generate", "--model",
                          str(tiny_llama), "--prompt", "hello there", "--max-tokens", "5",
                          "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--- length (5 tokens)" in out.stdout
    assert "capping max_model_len" not in out.stderr
